"""One summary of a benchmarks/gpu_check.sh run: what passed, and the figures a GPU gives.

  python benchmarks/gpu_summary.py --dir results/benchmarks/gpu

Reads what the run's steps wrote to --dir (steps.txt: one `name exit_status seconds`
line per step; limits.txt: one `name limit_s basis` line per step; smoke.json,
launch_floor.json, launch_floor_off.json, gpu_decode_off.json, gpu_decode.json,
kernel_timing.json, kernel_kept.json, kernel_check.json and scale_gptj_6b.json; a run
before the smoke step kept its ceiling in kernel_check.json, and its tiles in
kernel_tiles.json) and writes gpu_summary.json there: each step's status and limit, the
read ceiling the run measured (and the launch floor, with command buffers and without),
what a kernel costs in a decode (`launch_cost`: t = bytes / bandwidth + kernels × c
fitted to dense and GSI static at one sequence, kernels from the deviceless compile
--launches), each decode program's time, bytes and kernels a token side by side,
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
_LAUNCHES = flags.DEFINE_string(
    "launches", os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "results",
                             "benchmarks", "gpu_launches.json"),
    "The deviceless compile's counts (benchmarks/gpu_launches.py): kernels a token.")

STEPS, LIMITS = "steps.txt", "limits.txt"
BFLOAT16_BYTES = 2  # the timed calls' dtype (gpu_kernel.py times bfloat16)
CHECK, TIMING, TILES, KEPT, DECODE, SCALE = (
    "kernel_check.json", "kernel_timing.json", "kernel_tiles.json", "kernel_kept.json",
    "gpu_decode.json", "scale_gptj_6b.json")
SMOKE, FLOOR, FLOOR_OFF, DECODE_OFF = (
    "smoke.json", "launch_floor.json", "launch_floor_off.json", "gpu_decode_off.json")
STEP_OF = {CHECK: "kernel_check", TIMING: "kernel_timing", TILES: "kernel_tiles",
           KEPT: "kernel_kept", DECODE: "decode", SCALE: "scale", SMOKE: "smoke",
           FLOOR: "launch_floor", FLOOR_OFF: "launch_floor_off", DECODE_OFF: "decode_off"}
# gpu_decode.py's methods, as the deviceless compile names their programs.
PROGRAM_OF = {"dense": "dense", "gsi_static": "gsi_static", "gsi_p0.9": "gsi_coin",
              "gsi_p0.5": "gsi_coin", "gsi_eps0": "gsi_eps0", "sparsity_0.5": "sparsity"}
FULL_DEPTH = 28  # GPT-J-6B's layers


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
          "solve_s", "calibration_phase_s", "programs_compiled", "decode_layers",
          "decode_dtype", "decode_bases", "dense_tokens_per_s", "dense_bandwidth_gb_s",
          "points")
  out = {key: scale.get(key) for key in keep}
  for key in ("calibration_layer_s", "calibration_progress"):  # runs that recorded them
    if key in scale:
      out[key] = scale[key]
  if scale.get("dense_bandwidth_gb_s") is not None:
    out["dense_of_ceiling"] = _share(scale["dense_bandwidth_gb_s"], ceiling)
  for p in out.get("points") or []:
    p["of_ceiling"] = _share(p["bandwidth_gb_s"], ceiling)
  return out


def limits(folder: str) -> dict:
  """{step: {limit_s, basis}} from limits.txt ({} for a run before it)."""
  try:
    with open(os.path.join(folder, LIMITS), encoding="utf-8") as f:
      rows = [line.rstrip("\n").split(" ", 2) for line in f if line.strip()]
  except OSError:
    return {}
  return {name: {"limit_s": int(limit), "basis": basis} for name, limit, basis in rows}


def launch_counts(path: str) -> dict:
  """{"layers", "fit": {program: kernels a token}, "full": {program: kernels}} from the
  deviceless compile, or {"missing": why}."""
  try:
    with open(path, encoding="utf-8") as f:
      counted = json.load(f)
    return {"layers": counted["fit"]["layers"],
            "fit": {r["program"]: r["kernels_with_larger_branches"]
                    for r in counted["fit"]["records"]},
            "full": {r["program"]: r["kernels_with_larger_branches"]
                     for r in counted["records"] if r["batch"] == 1}}
  except (OSError, ValueError, KeyError) as e:
    return {"missing": f"{path}: {e}"}


def _one_sequence(decode: dict) -> dict:
  """{method: point} of a decode JSON's first batch when it is one sequence, dense too."""
  batches = [b for b in decode.get("batches", []) if b["batch"] == 1]
  if not batches or not batches[0]["points"]:
    return {}
  points = {p["method"]: p for p in batches[0]["points"]}
  first = next(iter(points.values()))
  dense_bytes = decode.get("dense_bytes_per_token")
  points["dense"] = {"method": "dense", "tokens_per_s": first["dense_tokens_per_s"],
                     "byte_ideal_speedup": 1.0}
  for p in points.values():
    p["seconds_per_token"] = 1 / p["tokens_per_s"]
    p["bytes_per_token"] = dense_bytes / p["byte_ideal_speedup"] \
        if dense_bytes and p.get("byte_ideal_speedup") else None
  return points


def fit_cost(points: dict, kernels: dict) -> dict:
  """c (seconds a kernel) and the bandwidth from t = bytes / bandwidth + kernels × c, solved
  for dense and GSI static, each at one sequence with its bytes and kernels a token."""
  try:
    (t_d, b_d, k_d), (t_s, b_s, k_s) = [
        (points[m]["seconds_per_token"], points[m]["bytes_per_token"], kernels[m])
        for m in ("dense", "gsi_static")]
  except (KeyError, TypeError):
    return {"missing": "dense, GSI static, their bytes and kernels a token are needed"}
  if None in (b_d, b_s, k_d, k_s) or k_s * b_d == k_d * b_s:
    return {"missing": "dense's and GSI static's bytes and kernels do not separate c"}
  c = (t_s * b_d - t_d * b_s) / (k_s * b_d - k_d * b_s)
  inverse_bandwidth = (t_d - k_d * c) / b_d
  return {"c_us": 1e6 * c,
          "bandwidth_gb_s": 1 / inverse_bandwidth / 1e9 if inverse_bandwidth > 0 else None,
          "from": {m: {"seconds_per_token": points[m]["seconds_per_token"],
                       "bytes_per_token": points[m]["bytes_per_token"],
                       "kernels_per_token": kernels[m]} for m in ("dense", "gsi_static")}}


def launch_cost(folder: str, ran: dict, counts: dict) -> dict:
  """The launch floor with command buffers and without, and c fitted to each's decode."""
  out = {}
  for mode, floor_file, decode_file in (("command_buffers", FLOOR, DECODE),
                                        ("no_command_buffers", FLOOR_OFF, DECODE_OFF)):
    floor = _read(folder, floor_file, ran)
    decode = _read(folder, decode_file, ran)
    kernels = {m: counts["fit"].get(PROGRAM_OF[m]) for m in PROGRAM_OF} \
        if "fit" in counts else {}
    out[mode] = {"launch_floor": floor.get("launch_floor", floor),
                 "fit": fit_cost(_one_sequence(decode), kernels) if kernels
                 else {"missing": counts.get("missing")}}
  out["kernels_from"] = (f"the deviceless compile at {counts['layers']} layers of GPT-J-6B's "
                         "shape (a dry run decodes another shape: its fit means nothing)"
                         if "fit" in counts else counts.get("missing"))
  return out


def decode_programs(decode: dict, counts: dict, fitted: dict) -> list | dict:
  """Each program at one sequence: time, bytes and kernels a token side by side, the fitted
  c beside them, and the time per layer (the token's over the layers, the embedding and LM
  head counted in it) scaled to GPT-J's 28 (which overstates those two)."""
  if "missing" in decode:
    return decode
  points = _one_sequence(decode)
  layers = decode.get("n_layers")
  rows = []
  for method, p in points.items():
    program = PROGRAM_OF.get(method)
    per_layer = p["seconds_per_token"] / layers if layers else None
    rows.append({"method": method, "layers": layers,
                 "seconds_per_token": p["seconds_per_token"],
                 "bytes_per_token": p["bytes_per_token"],
                 "kernels_per_token": counts.get("fit", {}).get(program),
                 "kernels_per_token_28_layers": counts.get("full", {}).get(program),
                 "c_us": fitted.get("c_us"), "seconds_per_layer": per_layer,
                 "seconds_per_token_28_layers_scaled": per_layer * FULL_DEPTH
                 if per_layer else None})
  return rows


def calibration_extrapolated(scale: dict) -> dict | None:
  """Full-depth calibration from fewer layers: the first layer (compiling in it) plus the
  later layers' mean time for each layer up to 28."""
  if "missing" in scale or scale.get("layers") in (None, FULL_DEPTH):
    return None
  out = {}
  for method, cumulative in (scale.get("calibration_layer_s") or {}).items():
    if len(cumulative) >= 2:
      later = (cumulative[-1] - cumulative[0]) / (len(cumulative) - 1)
      out[method] = {"layers": len(cumulative), "first_layer_s": cumulative[0],
                     "later_layer_s": later,
                     "full_depth_s": cumulative[-1] + (FULL_DEPTH - len(cumulative)) * later}
  return out or None


def summarise(folder: str, nominal: float, launches: str | None = None) -> dict:
  ran = steps(folder)
  check = _read(folder, CHECK, ran)
  smoke = _read(folder, SMOKE, ran) if "smoke" in ran else check  # before: kernel_check's
  measured = dict(smoke.get("ceiling", {}))
  floor = _read(folder, FLOOR, ran).get("launch_floor") if "launch_floor" in ran else None
  if measured and floor:
    measured["launch_floor"] = floor
  ceiling = measured.get("ceiling_gb_s")
  tiles = _read(folder, TILES, ran)
  counts = launch_counts(launches) if launches else {"missing": "no --launches"}
  scale = _read(folder, SCALE, ran)
  out = {"ceiling_gb_s": ceiling, "ceiling": measured or {"missing": smoke.get(
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
         "gptj_6b_shape": scale_figures(scale, ceiling)}
  if "smoke" in ran:  # a run with the smoke step: traces, limits, the launch cost
    out["trace_parses"] = smoke.get("trace_parses")
    out["limits"] = limits(folder)
    out["limits_s"] = sum(v["limit_s"] for v in out["limits"].values())
    cost = launch_cost(folder, ran, counts)
    out["launch_cost"] = cost
    out["decode_programs"] = decode_programs(_read(folder, DECODE, ran), counts,
                                             cost["command_buffers"]["fit"])
    out["calibration_full_depth"] = calibration_extrapolated(scale)
  return out


def main(argv):
  del argv
  if not os.path.isdir(_DIR.value):
    raise GSIError(f"--dir: {_DIR.value} is not a folder; give the folder gpu_check.sh wrote")
  experiment.finite("--nominal_gb_s", _NOMINAL.value, 0, 10**6, low_open=True)
  if _LAUNCHES.present and not os.path.isfile(_LAUNCHES.value):
    raise GSIError(f"--launches: {_LAUNCHES.value} is not a file; give the JSON "
                   "benchmarks/gpu_launches.py wrote")
  out = experiment.check_output_path(_OUT.value or os.path.join(_DIR.value, "gpu_summary.json"))
  experiment.write_json(out, summarise(_DIR.value, _NOMINAL.value, _LAUNCHES.value))


if __name__ == "__main__":
  cli.run(main, one_process="summarises one device's check")
