"""What the tests' compile flags buy and cost on this CPU: the gated kernel's interpreted
programs (the kernel tests' shapes, float32 and bfloat16) compiled and run under XLA's
defaults and under the flags the tests set (`tests/compile_flags.py`).

  python tools/compile_flags.py --out results/benchmarks/compile_flags.json

Each round starts one fresh process per setting, in turn (so nothing is cached in memory,
and a drift in the machine's speed reaches both alike); each process compiles every
program (`compile_s`, XLA's compile alone, tracing and lowering apart) and runs each
`--runs` times after a first call (`run_s`).  The flags' speed-up of compiling and their
slow-down of running are medians of the per-round ratios, with bootstrap intervals
(`gsi_jax.measure.benchmarking.ratio_interval`).  No persistent compilation cache is used.

With --tests, each process is instead one pytest run of those tests (node ids), with an
empty persistent compilation cache of its own, as on a fresh clone (the scripts a test
starts share it, as in the suite); `tests_s` is its wall time, and the flags' speed-up of
it is the median of the per-round ratios:

  python tools/compile_flags.py --rounds=3 --tests=tests/test_x.py::test_y,... \
      --out results/benchmarks/compile_flags_multiprocess.json
"""

import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

from absl import flags

from gsi_jax import cli, experiment
from gsi_jax.measure.benchmarking import ratio_interval, ratio_text
from gsi_jax.errors import GSIError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the tests' flags and shapes, from the repository's tests/ (not installed)
from tests.compile_flags import cheap_compile_flags  # pylint: disable=wrong-import-position
from tests.test_kernels import SHAPES  # pylint: disable=wrong-import-position

_ROUNDS = flags.DEFINE_integer("rounds", 5, "Paired rounds (one process per setting each).")
_RUNS = flags.DEFINE_integer("runs", 3, "Timed runs of each program after its first.")
_TESTS = flags.DEFINE_list("tests", [], "pytest node ids to time instead of the programs.")
_OUT = flags.DEFINE_string("out", "results/benchmarks/compile_flags.json", "Output JSON.")


PROGRAMS = """
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from gsi_jax.ops import gated_matmul_on
shapes, runs = json.loads(sys.argv[1]), int(sys.argv[2])
compile_s = run_s = 0.0
for T, D, K, O in shapes:
  for dtype in (jnp.float32, jnp.bfloat16):
    rng = np.random.default_rng(0)
    V = jnp.asarray(np.linalg.qr(rng.normal(size=(D, K)))[0], dtype)
    x = jnp.asarray(rng.normal(size=(T, D)), dtype)
    W = jnp.asarray(rng.normal(size=(D, O)) / np.sqrt(D), dtype)
    M = (V.T @ W).astype(dtype)
    fn = jax.jit(lambda eps: gated_matmul_on("cuda", x, x @ V, eps, [M], [W], interpret=True))
    lowered = fn.lower(0.1)
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s += time.perf_counter() - start
    jax.block_until_ready(compiled(0.1))
    start = time.perf_counter()
    for _ in range(runs):
      jax.block_until_ready(compiled(0.1))
    run_s += time.perf_counter() - start
print(json.dumps({"compile_s": compile_s, "run_s": run_s, "programs": 2 * len(shapes)}))
"""


def measure(xla_flags: str, runs: int) -> dict:
  """One fresh process's compile and run seconds under `xla_flags` (no persistent cache)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags, PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", PROGRAMS, json.dumps(SHAPES), str(runs)],
                        capture_output=True, text=True, env=env, cwd=ROOT, check=False)
  if proc.returncode:
    raise RuntimeError(f"the programs failed under XLA_FLAGS={xla_flags!r}:\n"
                       f"{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_tests(xla_flags: str, tests: list[str]) -> dict:
  """One pytest run of `tests` under `xla_flags` with an empty compilation cache: its wall
  seconds (the tests' own failures end the benchmark: a failing run times nothing)."""
  with tempfile.TemporaryDirectory(prefix="gsi_jax-compile-flags-") as cache:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags,
           "JAX_COMPILATION_CACHE_DIR": cache}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *tests], capture_output=True, text=True, env=env, cwd=ROOT,
                          check=False)
    seconds = time.perf_counter() - start
  if proc.returncode:
    raise RuntimeError(f"the tests failed under XLA_FLAGS={xla_flags!r}:\n"
                       f"{proc.stdout[-3000:]}")
  return {"tests_s": seconds}


def main(argv):
  del argv
  experiment.positive("--rounds", _ROUNDS.value)
  experiment.positive("--runs", _RUNS.value)
  out = experiment.check_output_path(_OUT.value)
  for test in _TESTS.value:
    if not os.path.isfile(os.path.join(ROOT, test.split("::")[0])):
      raise GSIError(f"--tests: {test.split('::')[0]} is not a test file of this repository; "
                     "give pytest node ids such as tests/test_kernels.py::test_name")
  jaxlib = importlib.metadata.version("jaxlib")
  cheap = cheap_compile_flags(jaxlib)
  records = []
  for r in range(_ROUNDS.value):
    if _TESTS.value:
      default, flagged = measure_tests("", _TESTS.value), measure_tests(cheap, _TESTS.value)
      logging.info("round %d/%d: the tests took %.1f s -> %.1f s", r + 1, _ROUNDS.value,
                   default["tests_s"], flagged["tests_s"])
    else:
      default, flagged = measure("", _RUNS.value), measure(cheap, _RUNS.value)
      logging.info("round %d/%d: compile %.2f s -> %.2f s, run %.3f s -> %.3f s", r + 1,
                   _ROUNDS.value, default["compile_s"], flagged["compile_s"],
                   default["run_s"], flagged["run_s"])
    records.append({"round": r, "default": default, "cheap": flagged})
  seconds = lambda setting, key: [rec[setting][key] for rec in records]
  speedup = lambda key: ratio_interval(seconds("default", key), seconds("cheap", key))
  text = lambda r: ratio_text(r["ratio"], r["ratio_low"], r["ratio_high"])
  config = {"rounds": _ROUNDS.value, "jaxlib": jaxlib, "cheap_flags": cheap}
  if _TESTS.value:
    tests_speedup = speedup("tests_s")
    logging.info("the tests ran %s faster", text(tests_speedup))
    experiment.write_json(out, {"config": {**config, "tests": _TESTS.value},
                                "records": records, "tests_speedup": tests_speedup})
    return
  compile_speedup = speedup("compile_s")
  run_slowdown = ratio_interval(seconds("cheap", "run_s"), seconds("default", "run_s"))
  logging.info("compiling %s faster, running %s slower", text(compile_speedup),
               text(run_slowdown))
  experiment.write_json(out, {
      "config": {**config, "runs": _RUNS.value, "shapes": SHAPES, "plan": "cuda, interpreted"},
      "records": records, "compile_speedup": compile_speedup, "run_slowdown": run_slowdown})


if __name__ == "__main__":
  cli.run(main, one_process="times one CPU process at a time")
