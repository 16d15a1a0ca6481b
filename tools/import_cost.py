"""What a Python process pays for its imports, in CPU seconds of fresh processes:

- under each ml_dtypes version: `import ml_dtypes`, and `import jax` (jax imports ml_dtypes
  first thing).  The test extra pins ml_dtypes by this record (setup.cfg): every test
  process, and every script a test starts, imports jax.
- from source or from bytecode: an experiment script's imports (`SCRIPT_IMPORTS`) where
  PYTHONDONTWRITEBYTECODE is set (some CI images set it) and no bytecode exists, as in a
  .venv that pip filled with --no-compile, so that every process compiles every module it
  imports; and where a first process wrote the bytecode.  The Makefile unsets the variable
  by this record.

  python tools/import_cost.py --out results/benchmarks/import_cost.json

Each ml_dtypes version's wheel is fetched from the package index (pip download, no
dependencies) into a temporary folder that goes first on PYTHONPATH, so each process
imports that version whatever the environment holds, and says which version it imported.
The bytecode comparison points Python's bytecode cache at a folder of its own
(`-X pycache_prefix`): an empty one, or one a first process filled.  The settings take
turns within each round (so a drift in the machine's speed reaches them alike); each
cost ratio is the median of the per-round ratios, with its bootstrap interval
(`gsi_jax.measure.benchmarking.ratio_interval`).
"""
import glob
import importlib.metadata
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
from gsi_jax.measure.benchmarking import ratio_interval, ratio_text
from gsi_jax.errors import GSIError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_VERSIONS = flags.DEFINE_list("versions", ["0.7.0", "0.6.0"],
                              "ml_dtypes versions; each is compared with the last.")
_ROUNDS = flags.DEFINE_integer("rounds", 9, "Rounds (one fresh process per setting and "
                               "statement each).")
_OUT = flags.DEFINE_string("out", "results/benchmarks/import_cost.json", "Output JSON.")

STATEMENTS = {"ml_dtypes": "import ml_dtypes", "jax": "import jax"}
SCRIPT_IMPORTS = "import gsi_jax, gsi_jax.experiment, transformers"


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


def child_cpu_seconds(args: list[str], env: dict[str, str]) -> tuple[float, str]:
  """User and system CPU seconds of a fresh Python process (its start included: the same
  for every setting) that runs `args`, and what it printed."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  proc = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, check=False)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  if proc.returncode:
    raise RuntimeError(f"python {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  return cpu, proc.stdout.strip()


def cpu_seconds(site: str, statement: str, version: str) -> float:
  """`statement`'s process with `site` (ml_dtypes `version`) first on its path."""
  cpu, printed = child_cpu_seconds(
      ["-c", f"{statement}; import ml_dtypes; print(ml_dtypes.__version__)"],
      {"PYTHONPATH": site})
  if printed != version:
    raise RuntimeError(f"{statement!r} imported ml_dtypes {printed}, not {version}")
  return cpu


def script_imports_seconds(pycache: str) -> float:
  """SCRIPT_IMPORTS' process with PYTHONDONTWRITEBYTECODE set and its bytecode cache in
  `pycache` (run from the repository, whose gsi_jax it imports)."""
  cpu, _ = child_cpu_seconds(["-X", f"pycache_prefix={pycache}", "-c", SCRIPT_IMPORTS],
                             {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": ROOT})
  return cpu


def bytecode_rounds(tmp: str, rounds: int) -> dict:
  """SCRIPT_IMPORTS from source (an empty bytecode cache that is never written) and from
  bytecode (a cache a first process filled), in alternating rounds."""
  source, written = os.path.join(tmp, "never-written"), os.path.join(tmp, "written")
  os.makedirs(source)
  child_cpu_seconds(["-X", f"pycache_prefix={written}", "-c", SCRIPT_IMPORTS],
                    {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPATH": ROOT})
  records = []
  for r in range(rounds):
    records.append({"from_source": script_imports_seconds(source),
                    "from_bytecode": script_imports_seconds(written)})
    logging.info("round %d/%d: %s from source %.2f CPU s, from bytecode %.2f", r + 1, rounds,
                 SCRIPT_IMPORTS, records[-1]["from_source"], records[-1]["from_bytecode"])
  if os.listdir(source):
    raise RuntimeError("bytecode was written where PYTHONDONTWRITEBYTECODE forbids it")
  seconds = lambda key: [rec[key] for rec in records]
  return {"statement": SCRIPT_IMPORTS, "records": records,
          "median_cpu_s": {k: float(np.median(seconds(k)))
                           for k in ("from_source", "from_bytecode")},
          "source_over_bytecode": ratio_interval(seconds("from_source"),
                                                 seconds("from_bytecode"))}


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
    bytecode = bytecode_rounds(tmp, _ROUNDS.value)
  seconds = lambda v, name: [rec[v][name] for rec in records]
  last = versions[-1]
  result = {"config": {"versions": versions, "rounds": _ROUNDS.value,
                       "python": sys.version.split()[0],
                       "installed_ml_dtypes": importlib.metadata.version("ml_dtypes")},
            "records": records,
            "median_cpu_s": {v: {name: float(np.median(seconds(v, name)))
                                 for name in STATEMENTS} for v in versions},
            # each version's CPU seconds over the last one's, per round
            "cost_over_last": {v: {name: ratio_interval(seconds(v, name), seconds(last, name))
                                   for name in STATEMENTS} for v in versions[:-1]},
            "bytecode": bytecode}
  for v in versions[:-1]:
    for name in STATEMENTS:
      c = result["cost_over_last"][v][name]
      logging.info("import %s under ml_dtypes %s: %.2f CPU s, %s the CPU of %s", name, v,
                   result["median_cpu_s"][v][name],
                   ratio_text(c["ratio"], c["ratio_low"], c["ratio_high"]), last)
  c = bytecode["source_over_bytecode"]
  logging.info("%s: %.2f CPU s from source, %.2f from bytecode, %s", SCRIPT_IMPORTS,
               bytecode["median_cpu_s"]["from_source"],
               bytecode["median_cpu_s"]["from_bytecode"],
               ratio_text(c["ratio"], c["ratio_low"], c["ratio_high"]))
  experiment.write_json(out, result)


if __name__ == "__main__":
  cli.run(main, one_process="times one CPU process at a time")
