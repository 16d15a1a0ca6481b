"""How benchmarks time: compile apart, then paired rounds that alternate the runs, and the
median of their ratios with a bootstrap interval."""

import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from gsi_jax.measure import benchmarking
from gsi_jax.errors import GSIError
from tests.test_experiments import assert_one_error_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Recorder:
  """A model whose generate notes which parameter tree it decoded, and how."""

  def __init__(self):
    self.calls = []

  def generate(self, params, ids, n, gate, stop_at_eos):
    self.calls.append((params, gate, n, stop_at_eos))
    return jnp.zeros((1, n), jnp.int32)


def test_decode_beside_compiles_each_first_then_alternates_each_round():
  model = Recorder()
  timed = benchmarking.decode_beside(model, None, 7, 3, "method", "gate", "dense")
  order = [params for params, *_ in model.calls]
  assert order == ["dense", "method"] * 4  # one compile each, then 3 rounds
  assert all(c[1:] == (("gate" if c[0] == "method" else None), 7, False) for c in model.calls)
  assert timed["tokens_per_s"] > 0 and timed["dense_tokens_per_s"] > 0
  assert timed["speedup_low"] <= timed["measured_speedup"] <= timed["speedup_high"]
  assert timed["rounds"] == 3 and timed["compile_s"] >= 0 and timed["dense_spread"] >= 1


def test_decode_beside_each_times_one_base_decode_a_round_beside_every_tree():
  model = Recorder()
  timed = benchmarking.decode_beside_each(model, None, 5, 2, [("a", "ga"), ("b", None)],
                                          "dense")
  assert [params for params, *_ in model.calls] == ["dense", "a", "b"] * 3
  assert [t["rounds"] for t in timed] == [2, 2] and len(timed) == 2
  # Two rounds: a ratio each, but no interval and no verdict.
  assert all(t["measured_speedup"] > 0 and t["speedup_low"] is None is t["speedup_high"]
             and t["verdict"] == "too few rounds" for t in timed)
  # Both ratios are taken against the same dense rounds.
  assert timed[0]["dense_tokens_per_s"] == timed[1]["dense_tokens_per_s"]


def test_one_run_decodes_once_to_compile_and_repeats_times():
  model = Recorder()
  tps, compile_s = benchmarking.decode_tokens_per_s(model, "dense", None, 5, 2)
  assert [c[0] for c in model.calls] == ["dense"] * 3 and tps > 0 and compile_s >= 0


@pytest.mark.parametrize("n, repeats, message", [(0, 3, "new tokens"), (4, 0, "timed repeats")])
def test_bad_counts_are_refused_before_any_decode(n, repeats, message):
  model = Recorder()
  with pytest.raises(GSIError, match=message):
    benchmarking.decode_beside(model, None, n, repeats, "method", None, "dense")
  assert not model.calls


def test_alternating_rounds_warm_each_fn_then_run_all_in_turn():
  order = []
  fns = [lambda: order.append("a"), lambda: order.append("b")]
  rounds, compile_s = benchmarking.alternating_rounds(fns, 3)
  assert order == ["a", "b"] * 4
  assert len(rounds) == 3 and all(len(r) == 2 for r in rounds) and len(compile_s) == 2


def test_ratio_interval_is_the_median_ratio_and_a_bootstrap_interval_around_it():
  steady = benchmarking.ratio_interval([2.0] * 6, [1.0] * 6)
  assert (steady["ratio"], steady["ratio_low"], steady["ratio_high"]) == (2.0, 2.0, 2.0)
  assert steady["rounds"] == 6 and steady["base_spread"] == 1.0
  assert (steady["interval"], steady["confidence"]) == ("bootstrap", 0.95)
  assert benchmarking.verdict(steady) == "faster"
  # Per-round ratios 0.8 to 1.2 (the base drifting from 1 to 3.5 s): the median is 1.0,
  # the interval holds it, and a drift of 3.5x is the base's spread.
  base = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
  noisy = benchmarking.ratio_interval(
      base, [b / r for b, r in zip(base, [0.8, 0.9, 0.95, 1.05, 1.1, 1.2])])
  assert noisy["ratio"] == pytest.approx(1.0)
  assert 0.8 <= noisy["ratio_low"] < 1.0 < noisy["ratio_high"] <= 1.2
  assert noisy["base_spread"] == pytest.approx(3.5)
  assert benchmarking.verdict(noisy) == "within noise"
  assert benchmarking.verdict(benchmarking.ratio_interval([1.0] * 7, [2.0] * 7)) == "slower"


@pytest.mark.parametrize("rounds, coverage", [(3, 0.75), (4, 0.875), (5, 0.9375)])
def test_three_to_five_rounds_give_their_range_with_its_coverage_and_no_verdict(rounds,
                                                                               coverage):
  """The range of n paired rounds covers the median ratio with probability 1 - 2 * 0.5**n:
  below 6 rounds that is short of 95%, so the interval is called the range it is."""
  ratios = [1.1, 1.3, 1.2, 1.4, 1.25][:rounds]
  pair = benchmarking.ratio_interval([r * 2.0 for r in ratios], [2.0] * rounds)
  assert (pair["ratio_low"], pair["ratio_high"]) == (min(ratios), max(ratios))
  assert pair["confidence"] == coverage and pair["interval"] == f"range of {rounds} rounds"
  assert benchmarking.verdict(pair) == "range only"


@pytest.mark.parametrize("rounds", [1, 2])
def test_fewer_than_three_rounds_give_a_ratio_but_no_interval_and_no_verdict(rounds):
  pair = benchmarking.ratio_interval([4.0] * rounds, [1.0] * rounds)
  assert pair["ratio"] == 4.0 and pair["rounds"] == rounds
  assert pair["ratio_low"] is None and pair["ratio_high"] is None
  assert benchmarking.verdict(pair) == "too few rounds"
  fields = benchmarking.interval_fields(pair)
  assert (fields["speedup_low"], fields["speedup_high"], fields["verdict"]) == (
      None, None, "too few rounds")
  assert benchmarking.ratio_text(4.0, None, None) == "4.00x (too few rounds for an interval)"
  assert benchmarking.ratio_text(1.5, 1.25, 1.75) == "1.50x [1.25, 1.75]"
  three = benchmarking.ratio_interval([4.0] * 3, [1.0] * 3)
  assert (three["ratio_low"], three["ratio_high"], three["interval"]) == (
      4.0, 4.0, "range of 3 rounds")


def test_ratio_interval_refuses_unpaired_rounds():
  with pytest.raises(GSIError, match="two equal non-empty lists"):
    benchmarking.ratio_interval([1.0, 2.0], [1.0])
  with pytest.raises(GSIError, match="two equal non-empty lists"):
    benchmarking.ratio_interval([], [])


@pytest.mark.parametrize("script, args, count", [
    ("linear.py", ["--d=64", "--d_out=96", "--k=16", "--fast_share=0,1", "--tokens=8",
                   "--copies=2", "--repeats=5"], 2),
    ("sparse_rows.py", ["--shapes=64x96", "--kept=0.5,1", "--variants=masked,gather",
                        "--tokens=8", "--copies=2", "--repeats=5"], 4),
])
def test_benchmarks_time_in_paired_rounds_with_an_interval(tmp_path, script, args, count):
  """Every timed record: the median ratio inside its 95% interval, the rounds, dense's spread."""
  out = tmp_path / "out.json"
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args,
                         f"--out={out}"], capture_output=True, text=True, cwd=ROOT,
                        timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = json.loads(out.read_text())["records"]
  assert len(records) == count
  for r in records:
    assert r["speedup_low"] <= r["measured_speedup"] <= r["speedup_high"]
    assert r["rounds"] == 5 and r["dense_spread"] >= 1
    assert r["verdict"] == "range only"  # 5 rounds: their range, short of 95%
    assert r["of_ideal"] == pytest.approx(r["measured_speedup"] / r["ideal_speedup"])


def test_linear_refuses_copies_that_do_not_fit_in_memory(tmp_path):
  """Copies sized from a large cache (or asked for) must fit in free memory: an error line,
  before any copy is built."""
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "linear.py"),
                         "--d=4096", "--d_out=16384", "--k=128", "--copies=100000",
                         f"--out={tmp_path / 'out.json'}"], capture_output=True, text=True,
                        cwd=ROOT, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  (line,) = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert "--copies: 100000 copies at d=4096, O=16384, k=128 need more than a third" in line
  assert not (tmp_path / "out.json").exists()


def test_copies_stop_at_a_third_of_free_memory():
  """A 503 MB cache asks for 480 copies of a 4096 x 4096 map at k = 128; 24 GiB free holds
  a third's worth, about 120."""
  plan = benchmarking.copies_plan([[4096], [4096], [128]], 4, 503316480, 24 * 2**30)
  per_copy = (2 * 4096 * 128 + 4096 * 4096) * 4
  assert plan == {(4096, 4096, 128): 24 * 2**30 // (3 * per_copy)}
  small = benchmarking.copies_plan([[64], [96], [16]], 4, 32 * 2**20, 24 * 2**30)
  assert small == {(64, 96, 16): math.ceil(4 * 32 * 2**20 / ((64 * 16 + 16 * 96) * 4))}


def test_conditionals_own_time_is_their_span_less_their_ops():
  """A cond of 10 µs running a 6 µs dot and a nested cond (2 µs, running a 1 µs op) costs
  10 - 6 - 1 = 3 µs of its own, the nested one's inside it and counted once."""
  events = [{"name": "cond.1", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
            {"name": "dot.3", "ts": 1, "dur": 6, "pid": 1, "tid": 1},
            {"name": "cond.2", "ts": 7, "dur": 2, "pid": 1, "tid": 1},
            {"name": "add_fusion", "ts": 7.5, "dur": 1, "pid": 1, "tid": 1},
            {"name": "dot.4", "ts": 12, "dur": 5, "pid": 1, "tid": 1},
            {"name": "dot.5", "ts": 2, "dur": 5, "pid": 1, "tid": 2}]  # another thread
  r = benchmarking._conditionals(events, n=1)
  assert r == {"conditionals_per_token": 2, "conditional_own_ms_per_token": 3e-3}


@pytest.mark.parametrize("bad, message", [
    (["--versions=0.7.0"], "--versions takes two or more distinct versions"),
    (["--versions=0.7.0,0.7.0"], "--versions takes two or more distinct versions"),
    (["--versions=0.7.0,latest"], "--versions takes two or more distinct versions"),
    (["--rounds=0"], "--rounds must be a positive whole number"),
    (["--out=/"], "--out: / is a folder")])
def test_import_cost_benchmark_bad_flags_exit_2(bad, message):
  """tools/import_cost.py checks its flags before it downloads anything."""
  proc = subprocess.run([sys.executable, "tools/import_cost.py", *bad], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert_one_error_line(proc, message)
