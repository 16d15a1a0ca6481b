"""The main job: dense vs GSI on the default model, end to end.

  python -m gsi_jax.demo [--model smollm2-135m --k 256 --eps 0.1 ...]

Loads the model, restores or calibrates bases on the calibration text,
generates greedily with dense and GSI weights, and evaluates perplexity
ratio and top-1 agreement on held-out text.
"""

from __future__ import annotations

import json
import logging
import time

import jax
import numpy as np
from absl import flags

import gsi_jax
from gsi_jax import cli, text
from gsi_jax.gsi import metrics
from gsi_jax.gsi.cache import DEFAULT_BASES_DIR, cached_bases

_MODEL = flags.DEFINE_string("model", gsi_jax.DEFAULT_MODEL, "Preset, .gguf, HF folder or hub id.")
_K = flags.DEFINE_integer("k", 256, "Subspace rank.")
_EPS = flags.DEFINE_float("eps", 0.1, "Gate threshold on rho = ||r|| / ||x||.")
_PROMPT = flags.DEFINE_string("prompt", "The Python interpreter reads a program and",
                              "Prompt for greedy generation.")
_NEW = flags.DEFINE_integer("max_new_tokens", 50, "Tokens to generate.")
_CALIB_FILE = flags.DEFINE_string("calib_text_file", text.PYDOC_CALIB, "Calibration text.")
_EVAL_FILE = flags.DEFINE_string("eval_text_file", text.PYDOC_EVAL, "Held-out evaluation text.")
_CALIB_TOKENS = flags.DEFINE_integer("calib_tokens", 16384, "Calibration tokens.")
_EVAL_TOKENS = flags.DEFINE_integer("eval_tokens", 4096, "Evaluation tokens.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Window length.")
_BASES_DIR = flags.DEFINE_string("bases_dir", DEFAULT_BASES_DIR, "Where bases are cached.")
_OUT = flags.DEFINE_string("out", None, "Optional JSON path for the summary.")


def timed_generate(model, params, ids, n, gate=None):
  """(ids, tokens/s, compile+first-run seconds); the timed run follows a warm-up."""
  t0 = time.perf_counter()
  jax.block_until_ready(model.generate(params, ids, n, gate))
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  out = jax.block_until_ready(model.generate(params, ids, n, gate))
  return np.asarray(out), n / (time.perf_counter() - t0), compile_s


def run_demo(model_name, k, eps, prompt, max_new_tokens, calib_source, eval_source,
             calib_tokens, eval_tokens, seq_len, bases_dir) -> dict:
  t0 = time.time()
  model = gsi_jax.load_model(model_name)
  logging.info("loaded %s in %.1f s", model.config.name, time.time() - t0)
  calib = text.windows(model, calib_source, seq_len, calib_tokens)
  held_out = text.windows(model, eval_source, seq_len, eval_tokens)
  bases = cached_bases(model, model.params, calib, k, bases_dir=bases_dir)
  params = gsi_jax.apply_gsi(model.params, bases, k)

  ids = model.encode(prompt)[None]
  logging.info("generating %d tokens, dense and GSI", max_new_tokens)
  dense_ids, dense_tps, _ = timed_generate(model, model.params, ids, max_new_tokens)
  gate = gsi_jax.make_gate(eps, skip_residual=True)  # batch 1: skip W x when all fast
  gsi_ids, gsi_tps, _ = timed_generate(model, params, ids, max_new_tokens, gate)
  _, decode_share = model.generate(params, ids, max_new_tokens, gate, return_stats=True)
  decode_bytes = metrics.byte_accounting(params, k, decode_share)

  logging.info("scoring %d held-out tokens, dense and GSI", held_out.n_tokens)
  dense_scores = metrics.score(model, model.params, held_out.ids)
  gsi_scores = metrics.score(model, params, held_out.ids, gsi_jax.make_gate(eps))
  quality = metrics.quality(dense_scores, gsi_scores)
  eval_bytes = metrics.byte_accounting(params, k, gsi_scores["fast_share_by_layer"])
  T = ids.shape[1]
  return {
      "model": model.config.name, "k": k, "eps": eps, "prompt": prompt,
      "dense_text": model.decode(dense_ids[0, T:]), "gsi_text": model.decode(gsi_ids[0, T:]),
      "identical": bool(np.array_equal(dense_ids, gsi_ids)),
      "decode_fast_share": metrics.mean_share(decode_share),
      "decode_speedup_paper": decode_bytes["speedup_paper"],
      "decode_speedup_bytes": decode_bytes["speedup_bytes"],
      "dense_tokens_per_s": dense_tps, "gsi_tokens_per_s": gsi_tps,
      "calibration": calib.describe(), "evaluation": held_out.describe(),
      **{key: quality[key] for key in ("ppl_dense", "ppl", "ppl_ratio", "top1_agreement",
                                       "fast_share", "fast_share_by_site")},
      "eval_speedup_paper": eval_bytes["speedup_paper"],
      "eval_speedup_bytes": eval_bytes["speedup_bytes"],
      "storage_overhead": eval_bytes["storage_overhead"],
  }


def report(r: dict) -> str:
  c, e = r["calibration"], r["evaluation"]
  return "\n".join([
      f"\n== {r['model']}: GSI k={r['k']}, eps={r['eps']} ==",
      f"prompt: {r['prompt']!r}",
      f"dense : {r['dense_text']!r}",
      f"GSI   : {r['gsi_text']!r}",
      f"identical: {r['identical']}",
      f"decode fast-path share: {r['decode_fast_share']:.1%}",
      f"speedup on weight reads: paper formula {r['decode_speedup_paper']:.2f}x, "
      f"true bytes per token {r['decode_speedup_bytes']:.2f}x",
      f"measured decode: dense {r['dense_tokens_per_s']:.1f} tok/s, "
      f"GSI {r['gsi_tokens_per_s']:.1f} tok/s ({r['gsi_tokens_per_s'] / r['dense_tokens_per_s']:.2f}x)",
      f"held-out text ({e['source']}, {e['tokens']} tokens; calibrated on {c['source']}, "
      f"{c['tokens']} tokens):",
      f"  perplexity dense {r['ppl_dense']:.3f}, GSI {r['ppl']:.3f}, ratio {r['ppl_ratio']:.4f}",
      f"  top-1 agreement {r['top1_agreement']:.2%}, fast-path share {r['fast_share']:.1%} "
      f"({', '.join(f'{s} {v:.1%}' for s, v in r['fast_share_by_site'].items())})",
      f"  speedup: paper formula {r['eval_speedup_paper']:.2f}x, true bytes "
      f"{r['eval_speedup_bytes']:.2f}x; M and V_k add {r['storage_overhead']:.1%} to the model",
  ])


def main(argv):
  del argv
  result = run_demo(_MODEL.value, _K.value, _EPS.value, _PROMPT.value, _NEW.value,
                    _CALIB_FILE.value, _EVAL_FILE.value, _CALIB_TOKENS.value, _EVAL_TOKENS.value,
                    _SEQ_LEN.value, _BASES_DIR.value)
  print(report(result))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  cli.run(main)
