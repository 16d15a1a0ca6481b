"""One summary of a benchmarks/gpu_check.sh run: what passed, and the figures a GPU gives.

  python benchmarks/gpu_summary.py --dir results/benchmarks/gpu --peak_bandwidth_gb_s 4800

Reads what the run's steps wrote to --dir (steps.txt: one `name exit_status seconds`
line per step; linear_pallas_bf16.json; scale_gptj_6b.json) and writes
gpu_summary.json there: each step's status, the kernel's GB/s against the HBM
peak at each forced fast share beside dense XLA in the same process, the
full-depth GPT-J-shaped calibration time and decode through the kernel.  A step
that failed or never ran is reported as such; the others still are.
"""

import json
import os

from absl import flags

from gsi_jax import cli, experiment
from gsi_jax.errors import GSIError

_DIR = flags.DEFINE_string("dir", "results/benchmarks/gpu", "The run's output folder.")
_PEAK = flags.DEFINE_float("peak_bandwidth_gb_s", 4800.0, "HBM peak (H200: 4800 GB/s).")
_OUT = flags.DEFINE_string("out", None, "JSON output (default: DIR/gpu_summary.json).")

STEPS, LINEAR, SCALE = "steps.txt", "linear_pallas_bf16.json", "scale_gptj_6b.json"


def _read(folder: str, name: str):
  try:
    with open(os.path.join(folder, name), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    return {"missing": f"{name}: {e}"}


def steps(folder: str) -> dict:
  try:
    with open(os.path.join(folder, STEPS), encoding="utf-8") as f:
      rows = [line.split() for line in f if line.strip()]
  except OSError:
    return {}
  return {name: {"exit_status": int(rc), "seconds": int(s), "passed": rc == "0"}
          for name, rc, s in rows}


def kernel_figures(linear: dict, peak: float) -> dict:
  if "missing" in linear:
    return linear
  rows = [{"d": r["d"], "d_out": r["d_out"], "k": r["k"], "fast_share": r["fast_share"],
           "kernel_gb_s": r["gsi_gb_s"], "kernel_of_peak": r["gsi_gb_s"] / peak,
           "dense_xla_gb_s": r["dense_gb_s"], "dense_xla_of_peak": r["dense_gb_s"] / peak,
           "kernel_speedup_over_dense": r["measured_speedup"],
           "byte_ideal_speedup": r["ideal_speedup"]} for r in linear["records"]]
  return {"devices": linear["config"]["devices"], "rows": rows}


def scale_figures(scale: dict) -> dict:
  if "missing" in scale:
    return scale
  keep = ("shape", "layers", "calib_tokens", "k", "devices", "load_s", "calibration_s",
          "solve_s", "decode_layers", "decode_dtype", "dense_tokens_per_s",
          "dense_bandwidth_gb_s", "dense_bandwidth_share", "points")
  return {key: scale.get(key) for key in keep}


def summarise(folder: str, peak: float) -> dict:
  return {"peak_bandwidth_gb_s": peak, "steps": steps(folder),
          "kernel_one_map": kernel_figures(_read(folder, LINEAR), peak),
          "gptj_6b_shape": scale_figures(_read(folder, SCALE))}


def main(argv):
  del argv
  if not os.path.isdir(_DIR.value):
    raise GSIError(f"--dir: {_DIR.value} is not a folder; give the folder gpu_check.sh wrote")
  if not _PEAK.value > 0:
    raise GSIError(f"--peak_bandwidth_gb_s must be > 0, got {_PEAK.value}")
  out = experiment.check_output_path(_OUT.value or os.path.join(_DIR.value, "gpu_summary.json"))
  experiment.write_json(out, summarise(_DIR.value, _PEAK.value))


if __name__ == "__main__":
  cli.run(main, one_process="summarises one device's check")
