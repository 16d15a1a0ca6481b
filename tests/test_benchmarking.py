"""How benchmarks time decodes: compile apart, then rounds that alternate the runs."""

import jax.numpy as jnp
import pytest

from gsi_jax import benchmarking
from gsi_jax.errors import GSIError


class Recorder:
  """A model whose generate notes which parameter tree it decoded, and how."""

  def __init__(self):
    self.calls = []

  def generate(self, params, ids, n, gate, stop_at_eos):
    self.calls.append((params, gate, n, stop_at_eos))
    return jnp.zeros((1, n), jnp.int32)


def test_paired_runs_compile_first_then_alternate_each_round():
  model = Recorder()
  timed = benchmarking.paired_tokens_per_s(model, None, 7, 3, [("method", "gate"), ("dense", None)])
  order = [params for params, *_ in model.calls]
  assert order == ["method", "dense"] * 4  # one compile each, then 3 rounds
  assert all(c[1:] == (("gate" if c[0] == "method" else None), 7, False) for c in model.calls)
  assert len(timed) == 2 and all(tps > 0 and compile_s >= 0 for tps, compile_s in timed)


def test_one_run_decodes_once_to_compile_and_repeats_times():
  model = Recorder()
  tps, compile_s = benchmarking.decode_tokens_per_s(model, "dense", None, 5, 2)
  assert [c[0] for c in model.calls] == ["dense"] * 3 and tps > 0 and compile_s >= 0


@pytest.mark.parametrize("n, repeats, message", [(0, 3, "new tokens"), (4, 0, "timed repeats")])
def test_bad_counts_are_refused_before_any_decode(n, repeats, message):
  model = Recorder()
  with pytest.raises(GSIError, match=message):
    benchmarking.paired_tokens_per_s(model, None, n, repeats, [("dense", None)])
  assert not model.calls


def test_alternating_rounds_warm_each_fn_then_run_all_in_turn():
  order = []
  fns = [lambda: order.append("a"), lambda: order.append("b")]
  rounds, compile_s = benchmarking.alternating_rounds(fns, 3)
  assert order == ["a", "b"] * 4
  assert len(rounds) == 3 and all(len(r) == 2 for r in rounds) and len(compile_s) == 2


def test_ratio_interval_is_the_median_ratio_and_a_bootstrap_interval_around_it():
  steady = benchmarking.ratio_interval([2.0] * 5, [1.0] * 5)
  assert (steady["ratio"], steady["ratio_low"], steady["ratio_high"]) == (2.0, 2.0, 2.0)
  assert steady["rounds"] == 5 and steady["base_spread"] == 1.0
  assert benchmarking.verdict(steady) == "faster"
  # Per-round ratios 0.8, 0.9, 1.0, 1.1, 1.2 (the base drifting from 1 to 3 s): the
  # median is 1.0, the interval holds it, and a drift of 3x is the base's spread.
  base = [1.0, 1.5, 2.0, 2.5, 3.0]
  noisy = benchmarking.ratio_interval(base, [b / r for b, r in zip(base, [0.8, 0.9, 1.0, 1.1, 1.2])])
  assert noisy["ratio"] == pytest.approx(1.0)
  assert 0.8 <= noisy["ratio_low"] < 1.0 < noisy["ratio_high"] <= 1.2
  assert noisy["base_spread"] == pytest.approx(3.0)
  assert benchmarking.verdict(noisy) == "within noise"
  assert benchmarking.verdict(benchmarking.ratio_interval([1.0] * 4, [2.0] * 4)) == "slower"


def test_ratio_interval_refuses_unpaired_rounds():
  with pytest.raises(GSIError, match="two equal non-empty lists"):
    benchmarking.ratio_interval([1.0, 2.0], [1.0])
  with pytest.raises(GSIError, match="two equal non-empty lists"):
    benchmarking.ratio_interval([], [])
