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
