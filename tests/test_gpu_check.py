"""benchmarks/gpu_check.sh end to end in its dry mode (small shapes on this CPU, the kernel
interpreted), which make test-jax011 also runs in the lent GPU image's package set, and
the summary it ends with."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest

from gsi_jax.ops.kernel import TOLERANCE
from tests.test_experiments import assert_one_error_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["smoke", "launch_floor", "launch_floor_off", "decode_off", "decode", "kernel_timing",
         "kernel_kept", "kernel_check", "scale"]


def run_benchmark(script, args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script)] + args,
                        capture_output=True, text=True, cwd=ROOT, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.long
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
  assert list(s["limits"]) == STEPS and s["limits_s"] == 345
  assert all(limit["basis"] for limit in s["limits"].values())
  assert s["ceiling_gb_s"] == max(s["ceiling"]["reduce_gb_s"], s["ceiling"]["copy_gb_s"]) > 0
  # A CPU's trace has no device stream: the smoke step says so, later steps time by wall clock.
  assert s["trace_parses"] is False and s["ceiling"]["reduce_device_gb_s"] is None
  assert "every later step times by wall clock" in proc.stdout
  for mode, on in (("command_buffers", True), ("no_command_buffers", False)):
    floor = s["launch_cost"][mode]["launch_floor"]
    assert floor["calls"] == 64 and floor["command_buffers"] is on
    assert all(floor[kind]["wall_us"] > 0 and floor[kind]["device_us"] is None
               for kind in ("pallas", "xla"))
    assert set(s["launch_cost"][mode]["fit"]) >= {"c_us", "bandwidth_gb_s", "from"}
  assert s["ceiling"]["launch_floor"] == s["launch_cost"]["command_buffers"]["launch_floor"]
  programs = {r["method"]: r for r in s["decode_programs"]}
  assert set(programs) == {"dense", "gsi_static", "gsi_p0.9", "gsi_p0.5", "gsi_eps0",
                           "sparsity_0.5"}
  for r in programs.values():  # the deviceless compile's counts at 4 layers, beside the time
    assert r["seconds_per_token"] > 0 and r["kernels_per_token"] > 0 and r["layers"] == 2
    assert r["seconds_per_token_28_layers_scaled"] == pytest.approx(
        14 * r["seconds_per_token"])
  fit = s["launch_cost"]["command_buffers"]["fit"]
  for m in ("dense", "gsi_static"):  # the fit reproduces both times it was solved from
    used = fit["from"][m]
    rebuilt = used["bytes_per_token"] / (fit["bandwidth_gb_s"] * 1e9) \
        if fit["bandwidth_gb_s"] else None
    if rebuilt is not None:
      assert rebuilt + used["kernels_per_token"] * fit["c_us"] * 1e-6 == pytest.approx(
          used["seconds_per_token"])
  calibration = s["calibration_full_depth"]["cascade"]
  assert calibration["layers"] == 2 and calibration["full_depth_s"] == pytest.approx(
      calibration["first_layer_s"] + 27 * calibration["later_layer_s"])
  c = s["correctness"]  # one bf16 case per map and regime
  assert c["cases"] == c["passed"] == 4 and not c["failed"]
  assert c["tolerance"] == {"bfloat16": TOLERANCE[jnp.dtype("bfloat16")]}
  calls = s["kernel_calls"]
  # 0.5 of one token rounds to 0; each all-fast call again as a chain of dependent sites
  assert [(r["tokens"], r["fast_share"], r["dependent"]) for r in calls] == [
      (1, 0.0, False), (1, 1.0, False), (1, 1.0, True), (2, 0.0, False), (2, 0.5, False),
      (2, 1.0, False), (2, 1.0, True)]
  kept = s["kept_calls"]
  shares = [(1, False), (1, True), (1, True), (2, False), (2, True), (2, True)]
  assert [(r["kernel"], r["tokens"], r["keep_share"] > 0) for r in kept] == [
      (kernel, *share) for kernel in ("kept_rows", "kept_dots") for share in shares]
  for r in kept:  # a row is read when any token keeps it: d = 256 rows of O = 512 (kept
    rows = 256 if r["kernel"] == "kept_rows" else 512  # rows), O = 512 of d (kept dots)
    assert 0 <= r["rows_read"] <= rows and r["passed"]
    assert r["relative_error"] <= TOLERANCE[jnp.dtype("bfloat16")]
    assert r["byte_ideal_speedup"] == (rows / r["rows_read"] if r["rows_read"] else None)
  assert [kept[i]["rows_read"] for i in (2, 5, 8, 11)] == [256, 256, 512, 512]  # all kept
  for r in calls + kept:
    assert r["speedup_low"] <= r["speedup"] <= r["speedup_high"] and r["rounds"] == 3
    assert r["kernel_of_ceiling"] == pytest.approx(r["kernel_gb_s"] / s["ceiling_gb_s"])
  # One token reads V_k (d x k) for g, then M (k x O) when fast or W (d x O) when slow:
  # d = 256, k = 32, O = 512.
  d, k, O = 256, 32, 512
  assert [r["byte_ideal_speedup"] for r in calls[:2]] == [d * O / (d * O + d * k),
                                                          d * O / (k * O + d * k)]
  assert all(r["byte_ideal_with_v_k"] == r["byte_ideal_speedup"] for r in calls)
  decode = s["whole_decode"]
  assert [(r["batch"], r["method"]) for r in decode] == [
      (b, m) for b in (1, 2) for m in ("gsi_static", "gsi_p0.9", "gsi_p0.5", "gsi_eps0",
                                       "sparsity_0.5")]
  one = {r["method"]: r for r in decode if r["batch"] == 1}
  assert one["gsi_static"]["fast_share"] == 1 and one["gsi_eps0"]["fast_share"] == 0
  assert 0 < one["gsi_p0.5"]["fast_share"] < one["gsi_p0.9"]["fast_share"] < 1
  assert one["gsi_eps0"]["byte_ideal_speedup"] == 1.0  # W alone: V_k is not read
  assert 0.3 < one["sparsity_0.5"]["kept_share"] < 0.7
  assert all("byte_ideal_speedup" not in r for r in decode if r["batch"] == 2)
  assert s["best_tile"] is None and "did not run" in s["tiles"]["missing"]  # not in the check
  gptj = s["gptj_6b_shape"]
  assert gptj["shape"] == "gptj-tiny" and gptj["calibration_s"]["cascade"] > 0
  assert set(gptj["calibration_phase_s"]["cascade"]) >= {"forward", "gram", "solve", "compile"}
  assert gptj["programs_compiled"]["cascade"]["after_first_layer"] == 0
  assert gptj["points"] is None and gptj["dense_tokens_per_s"] is None  # step 4 decodes


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
  assert_one_error_line(run_benchmark("gpu_summary.py", [
      f"--dir={tmp_path}", f"--launches={tmp_path / 'none.json'}"]), "--launches: ")


FAILING_PYTHON = """#!/bin/sh
# Every step fails; the summary runs (unless SUMMARY_FAILS is set).
case "$*" in *gpu_summary.py*) [ -z "$SUMMARY_FAILS" ] && exec {python} "$@";; esac
echo "failed on purpose" >&2
exit 3
"""


def _gpu_check(out, python=sys.executable, **env):
  return subprocess.run(["bash", "benchmarks/gpu_check.sh"], capture_output=True, text=True,
                        cwd=ROOT, timeout=120, env={**os.environ, "GPU_CHECK_DRY": "1",
                                                    "OUT": str(out), "PYTHON": python, **env})


@pytest.mark.parametrize("summary_fails", [False, True])
def test_failed_steps_fail_the_check_and_leave_no_stale_summary(tmp_path, summary_fails):
  """An earlier run's summary and step files are removed first; failures exit 1 with one
  error line naming them, and the summary is made from this run's files alone."""
  python = tmp_path / "python"
  python.write_text(FAILING_PYTHON.format(python=sys.executable))
  python.chmod(0o755)
  out = tmp_path / "out"
  out.mkdir()
  stale = {"ceiling": {"ceiling_gb_s": 3286.0}, "correct": []}
  for name in ("gpu_summary.json", "kernel_check.json", "kernel_timing.json"):
    (out / name).write_text(json.dumps(stale))
  proc = _gpu_check(out, str(python), **({"SUMMARY_FAILS": "1"} if summary_fails else {}))
  failed = STEPS + (["summary"] if summary_fails else [])
  assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert errors == [f"error: gpu_check: {len(failed)} failed ({' '.join(failed)}); their logs: "
                    f"{out}/NAME.log, their status: {out}/steps.txt"], proc.stderr[-2000:]
  assert "gpu_check done" not in proc.stdout
  assert not (out / "kernel_check.json").exists() and not (out / "kernel_timing.json").exists()
  if summary_fails:
    assert not (out / "gpu_summary.json").exists()
    return
  s = json.loads((out / "gpu_summary.json").read_text())
  assert s["failed_steps"] == STEPS and not any(step["passed"] for step in s["steps"].values())
  assert s["ceiling_gb_s"] is None and "No such file" in s["ceiling"]["missing"]


def test_an_output_folder_that_cannot_be_made_is_one_error_line(tmp_path):
  (tmp_path / "file").write_text("")
  proc = _gpu_check(tmp_path / "file" / "out")
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.splitlines() == [
      f"error: gpu_check cannot write to its output folder {tmp_path}/file/out; set OUT to a "
      "writable folder"]


def test_the_summary_reads_only_the_steps_this_run_ran(tmp_path):
  """A step's JSON left in the folder by another run is not read when steps.txt does not
  list that step."""
  (tmp_path / "steps.txt").write_text("kernel_check 0 10\n")
  (tmp_path / "kernel_timing.json").write_text(json.dumps({"timing": []}))
  proc = run_benchmark("gpu_summary.py", [f"--dir={tmp_path}"])
  assert proc.returncode == 0, proc.stderr[-2000:]
  s = json.loads((tmp_path / "gpu_summary.json").read_text())
  assert s["kernel_calls"] == {"missing": "kernel_timing.json: step kernel_timing did not run "
                               "(steps.txt)"}
  assert s["failed_steps"] == [] and "No such file" in s["correctness"]["missing"]


@pytest.mark.parametrize("args, message", [
    (["--parts=smoke,speed"], "--parts takes a list of"),
    (["--maps=4096"], "is not 2 positive whole numbers"),
    (["--maps=2²x512"], "--maps: '2²x512' is not positive whole numbers joined by x"),
    (["--ceiling_gib=inf"], "--ceiling_gib must be a finite number in (0, 1024], got inf"),
    (["--cache_mb=inf"], "--cache_mb must be a finite number in (0, 1048576], got inf"),
    (["--cache_mb=0"], "--cache_mb must be a finite number in (0, 1048576], got 0"),
    (["--tiles=64x8x4"], "needs blocks >= 16"),
    (["--tokens=0"], "--tokens takes positive whole numbers"),
    (["--fast_share=1.5"], "--fast_share takes numbers in [0, 1]"),
    (["--k=512", "--maps=256x512"], "must not exceed a map's d"),
    ([], "--out is required"),
])
def test_kernel_benchmark_bad_flags_exit_2(tmp_path, args, message):
  out = [] if message == "--out is required" else [f"--out={tmp_path / 'k.json'}"]
  assert_one_error_line(run_benchmark("gpu_kernel.py", args + out), message)


@pytest.mark.parametrize("args, message", [
    (["--batch=0"], "--batch takes positive whole numbers"),
    (["--layers=-1"], "--layers must be >= 0"),
    (["--new_tokens=0"], "--new_tokens"),
    ([], "--out is required"),
])
def test_decode_benchmark_bad_flags_exit_2(tmp_path, args, message):
  out = [] if message == "--out is required" else [f"--out={tmp_path / 'd.json'}"]
  assert_one_error_line(run_benchmark("gpu_decode.py", args + out), message)


def test_scale_in_memory_refuses_a_checkpoint_too(tmp_path):
  assert_one_error_line(run_benchmark("scale.py", [
      "--in_memory", f"--checkpoint={tmp_path}", "--shape=gptj-tiny"]),
      "--checkpoint and --in_memory exclude each other")


STOP_AFTER = """
saves = []
def save(result):  # records, then stops the run as a time limit would, between rows
{before}  saves.append({record})
  if {stop}:
    raise KeyboardInterrupt
try:
  {run}
except KeyboardInterrupt:
  print(json.dumps(saves))
"""


def stopped_saves(setup: str, run: str, record: str, stop: str, before: str = "") -> list:
  """What each save(result) of a benchmark's run recorded, in a fresh process (a script's
  flags would clash with a worker's) whose save raises KeyboardInterrupt once `stop` holds."""
  code = "import json, sys\n" + setup + STOP_AFTER.format(before=before, record=record,
                                                          stop=stop, run=run)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                        timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_stopped_kernel_benchmark_keeps_its_rows(tmp_path):
  """gpu_kernel.py rewrites its JSON after every row: a step cut short by its limit keeps
  the ceiling and the rows it finished (as the H200 run's kernel_check did)."""
  out = tmp_path / "k.json"
  setup = (f"sys.argv = ['gpu_kernel']\nfrom absl import flags\n"
           f"from benchmarks import gpu_kernel as g\n"
           f"flags.FLAGS(['gpu_kernel', '--dry', '--parts=smoke,correct', '--out={out}'])\n"
           f"c = g.config_from_flags()\n")
  saves = stopped_saves(setup, "g.run(c, save)", "len(result.get('correct', []))",
                        "saves[-1] == 3",
                        before="  g.experiment.write_json(c.out, result, partial=True)\n")
  assert saves == [0, 1, 2, 3]
  kept = json.loads(out.read_text())
  assert kept["complete"] is False  # saved partway, and says so
  assert kept["ceiling"]["ceiling_gb_s"] > 0 and len(kept["correct"]) == 3
  assert all(r["passed"] for r in kept["correct"])


def test_a_decode_step_killed_partway_keeps_its_rows(tmp_path):
  """gpu_decode.py rewrites its JSON after every method: SIGTERM (what a step's time limit
  sends) after its first row leaves a valid JSON with that row, marked incomplete."""
  out = tmp_path / "decode.json"
  proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_decode.py"),
                           "--dry", f"--out={out}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  rows = lambda: [p for b in json.loads(out.read_text())["batches"] for p in b["points"]]
  try:
    deadline = time.monotonic() + 240
    while not (out.exists() and rows()) and proc.poll() is None:
      assert time.monotonic() < deadline, "no row written in 240 s"
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 143, stderr[-2000:]
  kept = json.loads(out.read_text())
  assert kept["complete"] is False and rows()[0]["method"] == "gsi_static"
  assert len(rows()) < 10 and rows()[0]["compile_s"] > 0  # 2 batches x 5 methods when done


def test_a_calibration_step_cut_short_keeps_its_layers():
  """scale.py saves after every calibrated layer: a run stopped after the first (as a time
  limit would stop it) keeps how far it got, its phases and the layer's time."""
  setup = ("from benchmarks import scale\n"
           "cfg = scale.ScaleConfig(shape='gptj-tiny', checkpoint=None, layers=None, "
           "calib_tokens=256, seq_len=64, k=16, methods=('cascade',), eigh_layers=0, "
           "dtype='bfloat16', decode_layers=0, decode_dtype='float32', peak_bandwidth_gb_s=0.0, "
           "decode_k=16, new_tokens=4, repeats=1, impl='auto', out='unused.json', "
           "in_memory=True)\n")
  (first,) = stopped_saves(setup, "scale.run(cfg, save)", "result", "True")
  progress = first["calibration_progress"]["cascade"]
  assert progress["layers_done"] == 1 and progress["layers"] == 2
  assert len(progress["cumulative_layer_s"]) == 1 and progress["cumulative_layer_s"][0] > 0
  assert set(progress["phase_s"]) >= {"forward", "gram", "solve", "compile"}
  assert first["shape"] == "gptj-tiny" and first["layers"] == 2


H200 = os.path.join(ROOT, "results", "benchmarks", "gpu")


def test_the_h200_run_summary_is_its_files(tmp_path):
  """The committed H200 run (RESULTS §14.1): its summary is what gpu_summary.py makes of
  its files, and holds together."""
  proc = run_benchmark("gpu_summary.py", [f"--dir={H200}", f"--out={tmp_path / 's.json'}"])
  assert proc.returncode == 0, proc.stderr[-2000:]
  made = json.loads((tmp_path / "s.json").read_text())
  committed = json.loads(open(os.path.join(H200, "gpu_summary.json")).read())
  made.pop("run"), committed.pop("run")
  assert made["failed_steps"] == ["kernel_check", "kernel_tests", "scale"]
  for summary in (made, committed):  # scale never wrote its JSON: the message names a path
    summary["gptj_6b_shape"]["missing"] = os.path.basename(
        summary["gptj_6b_shape"]["missing"])
  assert made == committed
  s = committed  # its figures are marked in RESULTS §14.1 and checked there (test_docs.py)
  assert {k: v["exit_status"] for k, v in s["steps"].items()} == {
      "kernel_check": 124, "kernel_tests": 124, "kernel_timing": 0, "kernel_tiles": 0,
      "kernel_kept": 0, "scale": 124}
  assert s["ceiling_gb_s"] == max(s["ceiling"]["reduce_gb_s"], s["ceiling"]["copy_gb_s"])
  c = s["correctness"]  # the step's limit cut it short of its cases: none failed
  assert c["cases"] == c["passed"] and not c["failed"]
  for r in s["kernel_calls"]:  # V_k's read lowers every all-fast ideal
    if r["fast_share"] == 1.0:
      assert r["byte_ideal_with_v_k"] < r["byte_ideal_speedup"]
  assert all(r["passed"] for r in s["kept_calls"])
  assert s["best_tile"]["tile"] == min(s["best_tile"]["us_slow_plus_fast"],
                                       key=s["best_tile"]["us_slow_plus_fast"].get)
  scale = json.loads(open(os.path.join(H200, "rerun", "scale_gptj_6b.json")).read())
  assert scale["layers"] == 28 and scale["points"] == []  # its limit came before any point


def test_the_stated_bound_is_the_sum_of_every_limit():
  """The header's "at most 360 s" is the device line's timeout, each step's limit and the
  summary's timeout: nothing in the script runs unbounded, and a rerun fits in 15 minutes
  with the machine's start.  Every step states the basis of its limit."""
  script = open(os.path.join(ROOT, "benchmarks", "gpu_check.sh"), encoding="utf-8").read()
  steps = re.findall(r'^step (\w+) (\d+) "([^"]+)" ', script, re.M)
  timeouts = [int(s) for s in re.findall(r"timeout (\d+) ", script)]
  assert [name for name, _, _ in steps] == STEPS
  total = sum(int(limit) for _, limit, _ in steps) + sum(timeouts)
  assert total == 360 and "at most 360 s, 6.0 minutes" in script
  assert "the nine steps' limits 345 s" in script
  # Every command outside a step is under a timeout: the device line and the summary.
  assert re.findall(r"(timeout \d+ )?(nvidia-smi --query|\$PY -c|\$PY benchmarks/gpu_summary)",
                    script) == [("timeout 5 ", "nvidia-smi --query"),
                                ("timeout 10 ", "$PY benchmarks/gpu_summary")]


@pytest.mark.parametrize("venv, python, said", [
    (True, None, "gpu_check: python .venv/bin/python (this checkout's .venv)"),
    (False, None, "gpu_check: python python3 (no .venv here)"),
    (True, "/opt/py/bin/python3", "gpu_check: python /opt/py/bin/python3 (PYTHON)"),
])
def test_it_finds_its_interpreter_and_says_which(tmp_path, venv, python, said):
  """A clone with .venv runs the steps in it; the lent image (no .venv) in python3; PYTHON
  overrides both.  (Here every step fails or does nothing: only the first line matters.)"""
  if venv:
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / ".venv" / "bin" / "python").chmod(0o755)
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "GPU_CHECK_DRY")}
  proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")],
                        capture_output=True, text=True, cwd=tmp_path, timeout=60,
                        env={**env, "OUT": str(tmp_path / "out"),
                             **({"PYTHON": python} if python else {})})
  assert proc.stdout.splitlines()[0] == said, proc.stdout + proc.stderr


def test_the_headers_dry_run_time_is_the_committed_runs():
  """gpu_check.sh's header quotes its dry run's time from the summary that run wrote."""
  with open(os.path.join(ROOT, "results", "benchmarks", "gpu_check_dry.json"),
            encoding="utf-8") as f:
    dry = json.load(f)
  header = open(os.path.join(ROOT, "benchmarks", "gpu_check.sh"), encoding="utf-8").read()
  quoted = re.search(r"dry run's steps took (\d+) s on an idle 2-core (AMD EPYC)", header)
  assert quoted, "gpu_check.sh's header no longer quotes its dry run's time"
  assert int(quoted.group(1)) == sum(s["seconds"] for s in dry["steps"].values())
  assert dry["run"]["cpu"] == quoted.group(2) and dry["run"]["cpus"] == 2
  assert not dry["failed_steps"]


def test_sizes_past_the_shape_are_refused_before_any_compute(tmp_path):
  """gpu_decode: a prompt past the shape's positions; scale: a rank past its widest site
  (gptj-tiny: 256 positions, widest site 512), each one error line, nothing written."""
  assert_one_error_line(run_benchmark("gpu_decode.py", [
      "--dry", "--prompt_len=300", f"--out={tmp_path / 'd.json'}"]),
      "--prompt_len (300) plus --new_tokens (4) exceeds gptj-tiny's 256 positions")
  assert_one_error_line(run_benchmark("scale.py", [
      "--shape=gptj-tiny", "--in_memory", "--calib_tokens=1024", "--seq_len=64", "--k=16",
      "--decode_layers=1", "--decode_k=520", f"--out={tmp_path / 's.json'}"]),
      "--decode_k=520 exceeds the widest site of gptj-tiny (512)")
  assert not list(tmp_path.iterdir())


SLEEPING_PYTHON = """#!/bin/sh
# A step that computes until killed; it records its pid first.
echo $$ >> {pids}
exec sleep 120
"""


@pytest.mark.parametrize("signal_name, status", [("TERM", 143), ("INT", 130)])
def test_a_signal_ends_the_running_step_and_writes_no_summary(tmp_path, signal_name, status):
  """SIGTERM (as timeout or a scheduler sends it) or SIGINT to gpu_check.sh itself, during
  a step: the step's processes end with it, no summary is written, exit 143 or 130, and an
  interrupted: line says what was kept."""
  import signal
  import time
  pids = tmp_path / "pids"
  python = tmp_path / "python"
  python.write_text(SLEEPING_PYTHON.format(pids=pids))
  python.chmod(0o755)
  out = tmp_path / "out"
  proc = subprocess.Popen(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env={**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(out),
                               "PYTHON": str(python)})
  deadline = time.time() + 60
  while time.time() < deadline and len(pids.read_text().split() if pids.exists() else []) < 2:
    time.sleep(0.2)  # the device line's python, then the first step's
  step = int(pids.read_text().split()[-1])
  proc.send_signal(getattr(signal, f"SIG{signal_name}"))
  _, stderr = proc.communicate(timeout=30)
  assert proc.returncode == status, stderr
  assert "interrupted: gpu_check ended during a step" in stderr
  time.sleep(0.5)
  with pytest.raises(ProcessLookupError):
    os.kill(step, 0)
  assert not (out / "gpu_summary.json").exists()


def test_an_interrupted_benchmark_says_which_partial_json_it_kept(tmp_path):
  """Ctrl-C after gpu_kernel.py saved its first rows: the JSON says "complete": false and
  the interrupted: line names it (not "nothing partial was written")."""
  import signal
  import time
  out = tmp_path / "k.json"
  proc = subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_kernel.py"), "--dry",
       "--parts=timing", "--repeats=40", f"--out={out}"], cwd=ROOT, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  deadline = time.time() + 240
  while time.time() < deadline and not out.exists() and proc.poll() is None:
    time.sleep(0.2)
  proc.send_signal(signal.SIGINT)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 130, stderr[-2000:]
  assert json.loads(out.read_text())["complete"] is False
  said = [line for line in stderr.splitlines() if line.startswith("interrupted:")]
  assert said == [f'interrupted: the rows finished so far are in {out} ("complete": false)']
