"""What a `make results` run cost: its wall time, and each step's from the JSONs it wrote.

  python tools/results_cost.py --started 1796457600 --out results/benchmarks/make_results.json

`make results` passes the epoch second it started.  A step is a result JSON under
--results_dir written since then; its cost is the `run.wall_s` it records (from its
process's start to its write), so the steps that ran two at a time overlap, and its
`run.cpu_s`, the CPU time its process used: their sum over the machine's cores is the least
wall time the same work could take however its steps were packed.
"""

import glob
import json
import logging
import os
import time

from absl import flags

from gsi_jax import cli, experiment
from gsi_jax.errors import GSIError

_STARTED = flags.DEFINE_float("started", None, "Epoch second the run started (date +%s).")
_RESULTS_DIR = flags.DEFINE_string("results_dir", "results", "Where the run wrote its JSON.")
_OUT = flags.DEFINE_string("out", "results/benchmarks/make_results.json", "Output JSON.")


def steps_since(results_dir: str, started: float) -> list[dict]:
  """Each result JSON written since `started`, by write time, with its process's wall."""
  steps = []
  for path in glob.glob(os.path.join(results_dir, "*.json")):
    written = os.path.getmtime(path)
    if written < started:
      continue
    with open(path) as f:
      run = json.load(f).get("run") or {}
    steps.append({"json": os.path.basename(path), "wall_s": run.get("wall_s"),
                  "cpu_s": run.get("cpu_s"), "written_after_s": written - started})
  return sorted(steps, key=lambda step: step["written_after_s"])


def main(argv):
  del argv
  now = time.time()
  if _STARTED.value is None or not 0 < _STARTED.value <= now:
    raise GSIError(f"--started must be a past epoch second (date +%s), got {_STARTED.value}")
  if not os.path.isdir(_RESULTS_DIR.value):
    raise GSIError(f"--results_dir {_RESULTS_DIR.value} is not a directory")
  out = experiment.check_output_path(_OUT.value)
  steps = steps_since(_RESULTS_DIR.value, _STARTED.value)
  if not steps:
    raise GSIError(f"no JSON under {_RESULTS_DIR.value} was written since --started; pass the "
                   "second the run started")
  wall_s = now - _STARTED.value
  cpu = [step["cpu_s"] for step in steps]
  cpu_s = sum(cpu) if None not in cpu else None  # JSONs written before cpu_s was recorded
  logging.info("make results: %.1f min, %d JSON written", wall_s / 60, len(steps))
  experiment.write_json(out, {"config": {"started": _STARTED.value,
                                         "results_dir": _RESULTS_DIR.value},
                              "records": steps, "wall_s": wall_s, "wall_min": wall_s / 60,
                              "cpu_s": cpu_s, "cpus": os.cpu_count(),
                              "floor_min": None if cpu_s is None else
                              cpu_s / os.cpu_count() / 60})


if __name__ == "__main__":
  cli.run(main, one_process="reads the JSON a run wrote, with no compute to share")
