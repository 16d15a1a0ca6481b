"""Greedy decode tokens/s: JAX dense (and GSI points), against transformers PyTorch.

  python benchmarks/decode.py --out results/benchmarks/decode.json
  python benchmarks/decode.py --gsi 256:0.1,384:0.05 --out ...
  python benchmarks/decode.py --profile --torch=false --out results/benchmarks/decode_profile.json

Same prompt and length for every contender, in one run.  JAX timings follow
a compile-and-warm-up call, reported separately as compile_s.  The run first measures
the machine's read ceiling (a jitted sum and a copy over --ceiling_gib, past the
last-level cache), and every path reports its weight bytes per token and the bandwidth
they imply as a share of that ceiling.  --profile also splits dense decode's time between
matrix products, custom calls and everything else, with the op kinds that
take most (per-op tracing is on for the whole run, so its timings carry the
tracing's overhead) and the conditionals run per token with their own time, and
traces each GSI point the same way; --kept_all adds sparsity with every row kept
and --cats_all CATS with every channel kept (each at dense's bytes, through the
kept-rows kernels), timed beside dense and profiled the same way.  Where every row kept
decodes faster than XLA's dense (on CPU it does), the GSI points are timed beside it:
`best_dense` names the dense path their ratios are over.
"""

import importlib.util
import logging
import os
import time

import jax
from absl import flags

import gsi_jax
from gsi_jax import cli, experiment, metrics, peers, text
from gsi_jax.measure import benchmarking
from gsi_jax.measure.benchmarking import (best_time, decode_beside, decode_tokens_per_s, peak_rss_mib,
                                  ratio_text)
from gsi_jax.errors import GSIError
from gsi_jax.gsi.cache import DEFAULT_BASES_DIR, cached_bases
from gsi_jax.methods.evaluate import best_dense, every_row_kept
from gsi_jax.methods.front import XLA_DENSE
from gsi_jax.models import params as P

_MODEL = flags.DEFINE_string("model", gsi_jax.DEFAULT_MODEL, "Preset, .gguf, HF folder or hub id.")
_PROMPT = flags.DEFINE_string("prompt", "The Python interpreter reads a program and", "Prompt.")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per run.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed decodes: dense's median, and each GSI "
                                "point's paired rounds beside dense (PyTorch: best of them).")
_GSI = flags.DEFINE_list("gsi", [], "GSI operating points k:eps, e.g. 256:0.1,384:0.05.")
_KEPT_ALL = flags.DEFINE_bool("kept_all", False, "Also decode magnitude sparsity with every "
                              "row kept (the kept-rows fast path at dense's bytes) beside dense, "
                              "with --profile trace it too, and where it is faster time the GSI "
                              "points beside it instead (best_dense).")
_CATS_ALL = flags.DEFINE_bool("cats_all", False, "Also decode CATS with every channel kept "
                              "(its kernels at dense's bytes) beside dense, and with --profile "
                              "trace it too (a gated MLP only).")
_TORCH = flags.DEFINE_bool("torch", True, "Also time transformers PyTorch generate.")
_IMPL = flags.DEFINE_enum("impl", "auto", ["xla", "pallas", "auto"], "GSI's gated map "
                          "(auto: the kernel on a GPU, XLA on cpu).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights.")
_BASES_DIR = flags.DEFINE_string("bases_dir", DEFAULT_BASES_DIR, "Orbax bases cache.")
_CEILING_GIB = flags.DEFINE_float("ceiling_gib", 0.0, "GiB the read ceiling's sum reads (0: "
                                  "1 GiB or 4x the last-level cache, the larger).")
_PROFILE = flags.DEFINE_bool("profile", False, "Trace dense decode: time in matrix products "
                             "and in everything else.")
_OUT = flags.DEFINE_string("out", "results/benchmarks/decode.json", "JSON output.")
CALIB_SEQ_LEN = 256  # the GSI points' bases: 16384 tokens of pydoc:calibration in these windows


def ceiling_bytes() -> int:
  """What the read ceiling's sum reads: --ceiling_gib, or 1 GiB or 4x the last-level cache,
  whichever is larger; refused where a copy of it would not fit in a third of free memory."""
  n = int(_CEILING_GIB.value * 2**30) or max(2**30, 4 * benchmarking.last_level_cache_bytes())
  free = benchmarking.available_memory_bytes()
  if 3 * 2 * n > free:
    raise GSIError(f"--ceiling_gib: the read ceiling's {n / 2**30:.1f} GiB and its copy need more "
                   f"than a third of the {free / 2**30:.1f} GiB free; pass a smaller --ceiling_gib")
  return n


def of_ceiling(bytes_per_token: float, tokens_per_s: float, ceiling_gb_s: float) -> float:
  """The read bandwidth a decode implies, as a share of the measured read ceiling."""
  return bytes_per_token * tokens_per_s / (ceiling_gb_s * 1e9)


def torch_decode(path: str, ids, n, repeats):
  """transformers' generate on the file or folder the JAX model was loaded from."""
  import torch
  from transformers import AutoModelForCausalLM
  t0 = time.perf_counter()
  if path.endswith(".gguf"):
    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
  else:
    model = AutoModelForCausalLM.from_pretrained(path)
  load_s = time.perf_counter() - t0
  model.eval()
  x = torch.from_numpy(ids).long()
  def run():
    with torch.no_grad():
      model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
  run()  # warm-up
  return n / best_time(run, repeats), load_s


def parse_points(values):
  """--gsi as (k, eps) pairs, each checked, none repeated."""
  points = []
  for v in values:
    try:
      k, eps = v.split(":")
      points.append((int(k), float(eps)))
    except ValueError:
      raise GSIError(f"--gsi takes k:eps pairs like 256:0.1, got {v!r}") from None
    experiment.positive("--gsi k", points[-1][0])
    gsi_jax.ops.check_threshold("--gsi eps", points[-1][1])
  if len(set(points)) != len(points):
    raise GSIError(f"--gsi repeats a point ({','.join(values)}); give each once")
  return points


def check_flags() -> list[tuple[int, float]]:
  """Every flag that needs no model, before anything loads; returns the GSI points."""
  points = parse_points(_GSI.value)
  text.text_flag("--prompt", _PROMPT.value)
  experiment.positive("--max_new_tokens", _NEW.value)
  experiment.positive("--repeats", _REPEATS.value)
  experiment.finite("--ceiling_gib (0: sized from the cache)", _CEILING_GIB.value, 0, 1024)
  ceiling_bytes()
  if _TORCH.value and importlib.util.find_spec("torch") is None:
    raise GSIError("--torch needs PyTorch (pip install torch), or pass --torch=false")
  if _BASES_DIR.value:
    gsi_jax.gsi.checkpoint.check_writable(_BASES_DIR.value)
  return points


def check_against_model(model, points, ids) -> None:
  """The checks that need the model's shape, before any compute."""
  widest = P.widest_site(model.params)
  for k, _ in points:
    if k > widest:
      raise GSIError(f"--gsi k={k} exceeds the widest site of {model.config.name} ({widest})")
  if points:
    model.check_length(CALIB_SEQ_LEN, "the calibration window")
  if _CATS_ALL.value:
    peers.check_gated_mlp(model)
  if ids.shape[1] == 0:
    raise GSIError("--prompt encodes to no tokens; give some text")
  model.check_length(ids.shape[1] + _NEW.value, "--prompt plus --max_new_tokens")
  model.check_cache_fits(1, model.cache_tokens(ids.shape[1], _NEW.value))


def dense_equivalent(model, params, ids, n, label) -> dict:
  """A setting that reads dense's bytes through a sparse fast path: timed beside dense, and
  with --profile traced."""
  gate = gsi_jax.make_gate(0.0, batch1_switch=True)
  timed = decode_beside(model, ids, n, _REPEATS.value, params, gate, model.params)
  logging.info("%s: %s dense beside it", label, ratio_text(
      timed["measured_speedup"], timed["speedup_low"], timed["speedup_high"]))
  if _PROFILE.value:
    timed["profile"] = benchmarking.decode_profile(model, params, ids, n, gate)
    logging.info("%s, profile: %s", label, timed["profile"])
  return timed


def main(argv):
  del argv
  points = check_flags()
  out = experiment.check_output_path(_OUT.value)
  if _PROFILE.value:  # before jax starts its backend
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                               + benchmarking.TRACE_FLAG).strip()
  t0 = time.perf_counter()
  model = gsi_jax.load_model(_MODEL.value, _DTYPE.value)
  load_s = time.perf_counter() - t0
  ids = model.encode(_PROMPT.value)[None]
  check_against_model(model, points, ids)
  n = _NEW.value
  ceiling = benchmarking.read_ceiling(ceiling_bytes(), _REPEATS.value)
  ceiling_gb_s = ceiling["ceiling_gb_s"]
  utilisation = lambda bytes_per_token, tokens_per_s: of_ceiling(bytes_per_token, tokens_per_s,
                                                                 ceiling_gb_s)
  tps, compile_s = decode_tokens_per_s(model, model.params, ids, n, _REPEATS.value)
  dense_bytes = metrics.dense_bytes(model.params)
  result = {"model": model.config.name, "dtype": _DTYPE.value, "prompt_tokens": int(ids.shape[1]),
            "new_tokens": n, "load_s": load_s, "compile_s": compile_s,
            "jax_dense_tokens_per_s": tps, "dense_bytes_per_token": dense_bytes,
            "read_ceiling": ceiling, "read_ceiling_gb_s": ceiling_gb_s,
            "dense_gb_s": dense_bytes * tps / 1e9,
            "bandwidth_limit_tokens_per_s": ceiling_gb_s * 1e9 / dense_bytes,
            "dense_of_read_ceiling": utilisation(dense_bytes, tps),
            "per_op_tracing": _PROFILE.value,
            "peak_rss_mib": peak_rss_mib(), "devices": str(jax.devices()), "gsi": []}
  logging.info("JAX dense: %.1f tok/s (compile %.1f s), %.2f of the %.1f GB/s read ceiling",
               tps, compile_s, result["dense_of_read_ceiling"], ceiling_gb_s)
  if _PROFILE.value:
    result["dense_profile"] = benchmarking.decode_profile(model, model.params, ids, n)
    logging.info("dense profile: %s", result["dense_profile"])
  # The dense decode every point is timed beside: XLA's dot, or, where --kept_all decodes
  # faster than it (its interval above 1), the kept-rows kernel keeping every row, so that a
  # point's speed is its skipping and not the kernel's own (BUILD_NOTES).
  base_params, base_gate, result["best_dense"] = model.params, None, XLA_DENSE
  if _KEPT_ALL.value:
    result["best_dense"], (base_params, base_gate), result["kept_all"] = best_dense(
        model, model.params, ids, n, _REPEATS.value)
    if _PROFILE.value:
      kept_all, gate = every_row_kept(model.params)
      result["kept_all"]["profile"] = benchmarking.decode_profile(model, kept_all, ids, n, gate)
  if points:
    calib = text.windows(model, text.PYDOC_CALIB, CALIB_SEQ_LEN, 16384)
    bases = cached_bases(model, model.params, calib, max(k for k, _ in points),
                         bases_dir=_BASES_DIR.value or None)
    for k, eps in points:
      params = gsi_jax.apply_gsi(model.params, bases, k)
      gate = gsi_jax.make_gate(eps, impl=_IMPL.value, batch1_switch=True)
      timed = decode_beside(model, ids, n, _REPEATS.value, params, gate, base_params,
                            base_gate)
      g_tps = timed["tokens_per_s"]
      _, stats = model.generate(params, ids, n, gate, return_stats=True, stop_at_eos=False)
      share = stats["fast_share_by_layer"]
      b = metrics.byte_accounting(params, share, stats["rows_by_layer"])
      result["gsi"].append({
          "k": k, "eps": eps, "impl": gate.impl, "beside": result["best_dense"], **timed,
          "decode_fast_share": metrics.mean_share(share),
          "bytes_per_token": b["bytes_per_token"],
          "of_read_ceiling": utilisation(b["bytes_per_token"], g_tps),
          "predicted_speedup_bytes": b["speedup_bytes"],
          "predicted_speedup_paper": b["speedup_paper"]})
      if _PROFILE.value:
        result["gsi"][-1]["profile"] = benchmarking.decode_profile(model, params, ids, n, gate)
      logging.info("JAX GSI k=%d eps=%g: %.1f tok/s, %s the best dense beside it (%s)", k, eps,
                   g_tps, ratio_text(timed["measured_speedup"], timed["speedup_low"],
                                     timed["speedup_high"]), result["best_dense"])
  if _CATS_ALL.value:
    every_layer = {layer: 0.0 for layer in P.layers(model.params)}
    result["cats_all"] = dense_equivalent(
        model, peers.apply_cats(model, model.params, every_layer), ids, n,
        "CATS, every channel kept")
  if _TORCH.value:
    t_tps, t_load = torch_decode(model.source, ids, n, _REPEATS.value)
    result.update(torch_tokens_per_s=t_tps, torch_load_s=t_load,
                  torch_of_read_ceiling=utilisation(dense_bytes, t_tps),
                  jax_over_torch=tps / t_tps, peak_rss_mib_with_torch=peak_rss_mib())
    logging.info("PyTorch: %.1f tok/s", t_tps)
  experiment.write_json(out, result)


if __name__ == "__main__":
  cli.run(main, one_process="times one device's decode against PyTorch's")
