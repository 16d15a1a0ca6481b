"""benchmarks/gpu_check.sh end to end in its dry mode (small shapes on this CPU, the kernel
interpreted), which make test-jax011 also runs in the lent GPU image's package set, and
the summary it ends with."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from gsi_jax.ops.kernel import TOLERANCE
from tests.test_experiments import assert_one_error_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["kernel_check", "kernel_tests", "kernel_timing", "kernel_tiles", "kernel_kept",
         "scale"]


def run_benchmark(script, args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script)] + args,
                        capture_output=True, text=True, cwd=ROOT, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_dry_run_passes_every_step(tmp_path):
  """Every step passes and records its seconds (steps.txt; the dry mode's time is CI's
  record, not asserted here)."""
  proc = subprocess.run(["bash", "benchmarks/gpu_check.sh"], capture_output=True, text=True,
                        cwd=ROOT, timeout=400, env={**os.environ, "GPU_CHECK_DRY": "1",
                                                    "OUT": str(tmp_path),
                                                    "PYTHON": sys.executable})
  assert proc.returncode == 0, proc.stdout[-3000:]
  s = json.loads((tmp_path / "gpu_summary.json").read_text())
  assert list(s["steps"]) == STEPS
  assert all(step["passed"] for step in s["steps"].values()), s["steps"]
  assert s["ceiling_gb_s"] == max(s["ceiling"]["reduce_gb_s"], s["ceiling"]["copy_gb_s"]) > 0
  c = s["correctness"]
  assert c["cases"] == c["passed"] == 18 and not c["failed"]
  assert c["tolerance"] == {d.name: TOLERANCE[d] for d in map(jnp.dtype, ("float32", "bfloat16"))}
  calls = s["kernel_calls"]
  assert [(r["tokens"], r["fast_share"]) for r in calls] == [
      (1, 0.0), (1, 1.0), (2, 0.0), (2, 0.5), (2, 1.0)]  # 0.5 of one token rounds to 0
  kept = s["kept_calls"]
  assert [(r["tokens"], r["keep_share"] > 0) for r in kept] == [
      (1, False), (1, True), (1, True), (2, False), (2, True), (2, True)]
  for r in kept:  # a row is read when any token keeps it: rows_read of d = 256, O = 512
    assert 0 <= r["rows_read"] <= 256
    assert r["byte_ideal_speedup"] == (256 / r["rows_read"] if r["rows_read"] else None)
  assert kept[2]["rows_read"] == kept[5]["rows_read"] == 256  # every input kept
  for r in calls + s["tiles"] + kept:
    assert r["speedup_low"] <= r["speedup"] <= r["speedup_high"] and r["rounds"] == 3
    assert r["kernel_of_ceiling"] == pytest.approx(r["kernel_gb_s"] / s["ceiling_gb_s"])
  # One token reads M (k x O) when fast and W (d x O) when slow: d = 256, k = 32.
  assert [r["byte_ideal_speedup"] for r in calls[:2]] == [1.0, 8.0]
  assert s["best_tile"]["tile"] in ("32x128x4", "64x64x4")
  gptj = s["gptj_6b_shape"]
  assert gptj["shape"] == "gptj-tiny" and gptj["calibration_s"]["cascade"] > 0
  assert [p["impl"] for p in gptj["points"]] == ["pallas"] * 3
  assert gptj["dense_of_ceiling"] == pytest.approx(gptj["dense_bandwidth_gb_s"]
                                                   / s["ceiling_gb_s"])


def test_summary_reports_missing_steps(tmp_path):
  """A run whose steps died leaves a summary that says so, not a traceback."""
  (tmp_path / "steps.txt").write_text("kernel_check 124 60\n")
  proc = run_benchmark("gpu_summary.py", [f"--dir={tmp_path}"])
  assert proc.returncode == 0, proc.stderr[-2000:]
  s = json.loads((tmp_path / "gpu_summary.json").read_text())
  assert s["steps"] == {"kernel_check": {"exit_status": 124, "seconds": 60, "passed": False}}
  assert s["ceiling_gb_s"] is None and "missing" in s["ceiling"]
  assert "missing" in s["correctness"] and "missing" in s["gptj_6b_shape"]
  assert "missing" in s["kernel_calls"] and s["best_tile"] is None
  assert_one_error_line(run_benchmark("gpu_summary.py", [f"--dir={tmp_path / 'nowhere'}"]),
                        "is not a folder")


@pytest.mark.parametrize("args, message", [
    (["--parts=ceiling,speed"], "--parts takes a list of"),
    (["--maps=4096"], "is not 2 positive whole numbers"),
    (["--tiles=64x8x4"], "needs blocks >= 16"),
    (["--tokens=0"], "--tokens takes positive whole numbers"),
    (["--fast_share=1.5"], "--fast_share takes numbers in [0, 1]"),
    (["--k=512", "--maps=256x512"], "must not exceed a map's d"),
    ([], "--out is required"),
])
def test_kernel_benchmark_bad_flags_exit_2(tmp_path, args, message):
  out = [] if message == "--out is required" else [f"--out={tmp_path / 'k.json'}"]
  assert_one_error_line(run_benchmark("gpu_kernel.py", args + out), message)


def test_scale_in_memory_refuses_a_checkpoint_too(tmp_path):
  assert_one_error_line(run_benchmark("scale.py", [
      "--in_memory", f"--checkpoint={tmp_path}", "--shape=gptj-tiny"]),
      "--checkpoint and --in_memory exclude each other")
