"""What a Python process pays to import ml_dtypes, under each ml_dtypes version: the CPU
seconds of a fresh process that runs `import ml_dtypes`, and of one that runs `import jax`
(jax imports ml_dtypes first thing).  The test extra pins ml_dtypes by this record
(setup.cfg): every test process, and every script a test starts, imports jax.

  python benchmarks/import_cost.py --out results/benchmarks/import_cost.json

Each version's wheel is fetched from the package index (pip download, no dependencies)
into a temporary folder that goes first on PYTHONPATH, so each process imports that
version whatever the environment holds, and says which version it imported.  The
versions take turns within each round (so a drift in the machine's speed reaches them
alike); each version's cost over the last one's is the median of the per-round ratios,
with its bootstrap interval (`gsi_jax.benchmarking.ratio_interval`).
"""

import glob
import logging
import os
import re
import resource
import subprocess
import sys
import tempfile
import zipfile

from absl import flags
import numpy as np

from gsi_jax import cli, experiment
from gsi_jax.benchmarking import ratio_interval, ratio_text
from gsi_jax.errors import GSIError

_VERSIONS = flags.DEFINE_list("versions", ["0.7.0", "0.6.0"],
                              "ml_dtypes versions; each is compared with the last.")
_ROUNDS = flags.DEFINE_integer("rounds", 9, "Rounds (one fresh process per version and "
                               "statement each).")
_OUT = flags.DEFINE_string("out", "results/benchmarks/import_cost.json", "Output JSON.")

STATEMENTS = {"ml_dtypes": "import ml_dtypes", "jax": "import jax"}


def fetch(version: str, folder: str) -> str:
  """A folder holding ml_dtypes `version` alone, unpacked from its wheel for this Python."""
  proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                         "--only-binary=:all:", f"ml_dtypes=={version}", "-d", folder],
                        capture_output=True, text=True, check=False)
  wheels = glob.glob(os.path.join(folder, "ml_dtypes-*.whl"))
  if proc.returncode or len(wheels) != 1:
    why = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
    raise GSIError(f"--versions: pip could not download ml_dtypes {version} for this Python "
                   f"({why}); give versions that the package index holds")
  site = os.path.join(folder, "site")
  with zipfile.ZipFile(wheels[0]) as wheel:
    wheel.extractall(site)
  return site


def cpu_seconds(site: str, statement: str, version: str) -> float:
  """User and system CPU seconds of a fresh process that runs `statement` with `site` first
  on its path (the process start included: it is the same for every version)."""
  env = {**os.environ, "PYTHONPATH": site, "JAX_PLATFORMS": "cpu"}
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  proc = subprocess.run(
      [sys.executable, "-c", f"{statement}; import ml_dtypes; print(ml_dtypes.__version__)"],
      capture_output=True, text=True, env=env, check=False)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  if proc.returncode or proc.stdout.strip() != version:
    raise RuntimeError(f"{statement!r} under ml_dtypes {version} printed "
                       f"{proc.stdout.strip()!r}:\n{proc.stderr[-2000:]}")
  return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv):
  del argv
  versions = _VERSIONS.value
  if len(versions) < 2 or len(set(versions)) != len(versions) or not all(
      re.fullmatch(r"\d+(\.\d+)*", v) for v in versions):
    raise GSIError(f"--versions takes two or more distinct versions such as 0.7.0,0.6.0, "
                   f"got {versions}")
  experiment.positive("--rounds", _ROUNDS.value)
  out = experiment.check_output_path(_OUT.value)
  with tempfile.TemporaryDirectory(prefix="gsi_jax-import-cost-") as tmp:
    sites = {v: fetch(v, os.path.join(tmp, v)) for v in versions}
    records = []
    for r in range(_ROUNDS.value):
      records.append({v: {name: cpu_seconds(sites[v], statement, v)
                          for name, statement in STATEMENTS.items()} for v in versions})
      logging.info("round %d/%d: %s", r + 1, _ROUNDS.value, ", ".join(
          f"{v}: ml_dtypes {records[-1][v]['ml_dtypes']:.2f} s, jax "
          f"{records[-1][v]['jax']:.2f} s" for v in versions))
  seconds = lambda v, name: [rec[v][name] for rec in records]
  last = versions[-1]
  result = {"config": {"versions": versions, "rounds": _ROUNDS.value,
                       "python": sys.version.split()[0]},
            "records": records,
            "median_cpu_s": {v: {name: float(np.median(seconds(v, name)))
                                 for name in STATEMENTS} for v in versions},
            # each version's CPU seconds over the last one's, per round
            "cost_over_last": {v: {name: ratio_interval(seconds(v, name), seconds(last, name))
                                   for name in STATEMENTS} for v in versions[:-1]}}
  for v in versions[:-1]:
    for name in STATEMENTS:
      c = result["cost_over_last"][v][name]
      logging.info("import %s under ml_dtypes %s: %.2f CPU s, %s the CPU of %s", name, v,
                   result["median_cpu_s"][v][name],
                   ratio_text(c["ratio"], c["ratio_low"], c["ratio_high"]), last)
  experiment.write_json(out, result)


if __name__ == "__main__":
  cli.run(main, one_process="times one CPU process at a time")
