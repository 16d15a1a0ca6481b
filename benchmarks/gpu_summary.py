"""One summary of a benchmarks/gpu_check.sh run: what passed, and the figures a GPU gives.

  python benchmarks/gpu_summary.py --dir results/benchmarks/gpu

Reads what the run's steps wrote to --dir (steps.txt: one `name exit_status seconds`
line per step; kernel_check.json, kernel_timing.json, kernel_tiles.json,
kernel_kept.json, gpu_decode.json and scale_gptj_6b.json) and writes gpu_summary.json
there: each step's status, the read ceiling the run measured (and the launch floor),
the kernel's correctness, its calls beside dense at each token count and fast share
(and every bandwidth as a share of that ceiling, device times where the trace had
them), the best decode tile, the kept-rows and kept-dots kernels beside dense at each
kept share (with each one's error against its reference), the whole decode of every
method beside dense (where the run had that step), and the full-depth GPT-J-shaped
calibration time and decode.  A step that failed or
never ran is reported as such; the others still are.  --nominal_gb_s (H200: 4800) is
reported beside the measured ceiling, never divided by.
"""

import json
import os

from absl import flags

from gsi_jax import cli, experiment
from gsi_jax.errors import GSIError

_DIR = flags.DEFINE_string("dir", "results/benchmarks/gpu", "The run's output folder.")
_NOMINAL = flags.DEFINE_float("nominal_gb_s", 4800.0, "The device's nominal HBM bandwidth "
                              "(H200: 4800 GB/s), reported beside the measured ceiling.")
_OUT = flags.DEFINE_string("out", None, "JSON output (default: DIR/gpu_summary.json).")

STEPS = "steps.txt"
BFLOAT16_BYTES = 2  # the timed calls' dtype (gpu_kernel.py times bfloat16)
CHECK, TIMING, TILES, KEPT, DECODE, SCALE = (
    "kernel_check.json", "kernel_timing.json", "kernel_tiles.json", "kernel_kept.json",
    "gpu_decode.json", "scale_gptj_6b.json")
STEP_OF = {CHECK: "kernel_check", TIMING: "kernel_timing", TILES: "kernel_tiles",
           KEPT: "kernel_kept", DECODE: "decode", SCALE: "scale"}


def _read(folder: str, name: str, ran: dict):
  """A step's JSON, once steps.txt says this run ran that step (a file an earlier run left
  is not this run's)."""
  step = STEP_OF[name]
  if step not in ran:
    return {"missing": f"{name}: step {step} did not run (steps.txt)"}
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


def _share(gb_s, ceiling):
  return gb_s / ceiling if ceiling else None


def correctness(check: dict) -> dict:
  if "missing" in check or "correct" not in check:
    return {"missing": check.get("missing", "kernel_check.json has no correct part")}
  rows = check["correct"]
  worst = {}
  for r in rows:
    worst[r["dtype"]] = max(worst.get(r["dtype"], 0.0), r["relative_error"])
  return {"cases": len(rows), "passed": sum(r["passed"] for r in rows),
          "worst_relative_error": worst,
          "tolerance": {r["dtype"]: r["tolerance"] for r in rows},
          "failed": [r for r in rows if not r["passed"]]}


def kernel_rows(timed: dict, ceiling) -> list | dict:
  if "missing" in timed:
    return timed
  keys = ("d", "out", "tokens", "kernel_us", "dense_us", "kernel_gb_s", "dense_gb_s",
          "byte_ideal_speedup", "verdict")
  optional = ("kernel", "k", "fast_share", "dependent", "keep_share", "rows_read",
              "relative_error", "passed", "block_o", "block_d", "num_warps",
              "kernel_device_us", "dense_device_us")
  rows = []
  for part in ("timing", "tiles", "kept"):
    for r in timed.get(part, []):
      row = {key: r[key] for key in keys}
      row.update({key: r[key] for key in optional if key in r})
      row.update({key: r[key] for key in ("speedup", "speedup_low", "speedup_high", "rounds")},
                 kernel_of_ceiling=_share(r["kernel_gb_s"], ceiling),
                 dense_of_ceiling=_share(r["dense_gb_s"], ceiling))
      if part != "kept":  # a decode reads V_k for g = x V_k on every token, fast or slow;
        # rows that carry v_bytes timed g = x V_k and count V_k already (the first H200
        # run's, in results/benchmarks/gpu, did neither)
        v_k_bytes = 0 if "v_bytes" in r else r["d"] * r["k"] * BFLOAT16_BYTES
        row["byte_ideal_with_v_k"] = r["dense_weight_bytes"] / (r["kernel_weight_bytes"]
                                                                + v_k_bytes)
      rows.append(row)
  return rows


def best_tile(tiles) -> dict | None:
  """The tile plan with the least summed time over all slow and all fast."""
  if not isinstance(tiles, list) or not tiles:
    return None
  total = {}
  for r in tiles:
    key = f"{r['block_o']}x{r['block_d']}x{r['num_warps']}"
    total[key] = total.get(key, 0.0) + r["kernel_us"]
  return {"tile": min(total, key=total.get), "us_slow_plus_fast": total}


def whole_decode(decode: dict) -> dict | list:
  """Per batch and method: tokens/s beside dense, the interval, and at one sequence the byte
  ideal and the share of it reached."""
  if "missing" in decode:
    return decode
  keys = ("method", "tokens_per_s", "dense_tokens_per_s", "measured_speedup", "speedup_low",
          "speedup_high", "rounds", "compile_s", "fast_share", "kept_share",
          "byte_ideal_speedup")
  out = []
  for b in decode.get("batches", []):
    for p in b["points"]:
      row = {"batch": b["batch"], **{k: p[k] for k in keys if k in p}}
      if p.get("byte_ideal_speedup"):
        row["of_byte_ideal"] = p["measured_speedup"] / p["byte_ideal_speedup"]
      out.append(row)
  return out


def scale_figures(scale: dict, ceiling) -> dict:
  if "missing" in scale:
    return scale
  keep = ("shape", "layers", "calib_tokens", "k", "devices", "load_s", "calibration_s",
          "solve_s", "calibration_phase_s", "programs_compiled", "decode_layers", "decode_dtype", "decode_bases", "dense_tokens_per_s",
          "dense_bandwidth_gb_s", "points")
  out = {key: scale.get(key) for key in keep}
  if scale.get("dense_bandwidth_gb_s") is not None:
    out["dense_of_ceiling"] = _share(scale["dense_bandwidth_gb_s"], ceiling)
  for p in out.get("points") or []:
    p["of_ceiling"] = _share(p["bandwidth_gb_s"], ceiling)
  return out


def summarise(folder: str, nominal: float) -> dict:
  ran = steps(folder)
  check = _read(folder, CHECK, ran)
  measured = check.get("ceiling", {})
  ceiling = measured.get("ceiling_gb_s")
  tiles = _read(folder, TILES, ran)
  return {"ceiling_gb_s": ceiling, "ceiling": measured or {"missing": check.get(
              "missing", "kernel_check.json has no ceiling part")},
          "nominal_gb_s": nominal,
          "ceiling_of_nominal": _share(ceiling, nominal) if ceiling else None,
          "steps": ran, "failed_steps": [name for name, s in ran.items() if not s["passed"]],
          "correctness": correctness(check),
          "kernel_calls": kernel_rows(_read(folder, TIMING, ran), ceiling),
          "tiles": kernel_rows(tiles, ceiling), "best_tile": best_tile(tiles.get("tiles")),
          "kept_calls": kernel_rows(_read(folder, KEPT, ran), ceiling),
          **({"whole_decode": whole_decode(_read(folder, DECODE, ran))}
             if "decode" in ran else {}),
          "gptj_6b_shape": scale_figures(_read(folder, SCALE, ran), ceiling)}


def main(argv):
  del argv
  if not os.path.isdir(_DIR.value):
    raise GSIError(f"--dir: {_DIR.value} is not a folder; give the folder gpu_check.sh wrote")
  experiment.finite("--nominal_gb_s", _NOMINAL.value, 0, 10**6, low_open=True)
  out = experiment.check_output_path(_OUT.value or os.path.join(_DIR.value, "gpu_summary.json"))
  experiment.write_json(out, summarise(_DIR.value, _NOMINAL.value))


if __name__ == "__main__":
  cli.run(main, one_process="summarises one device's check")
