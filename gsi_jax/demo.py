"""The main job: dense vs GSI on the default model, end to end.

  python -m gsi_jax.demo [--model smollm2-135m --k 256 --eps 0.1 --impl xla --out demo.json]

Loads the model, restores or calibrates bases on the calibration text,
generates greedily with dense and GSI weights (batch 1, stopping at the
end-of-sequence token), times GSI's decode beside the faster dense decode (XLA's dot,
or on CPU the kept-rows kernel keeping every row) in paired rounds (the median ratio
and its 95% interval), and evaluates perplexity ratio and top-1
agreement on held-out text.  Flags are defined only when run as a script.
"""

from __future__ import annotations

import time

import numpy as np
from absl import flags

import gsi_jax
from gsi_jax import cli, experiment, metrics, progress, text
from gsi_jax.measure import benchmarking, provenance
from gsi_jax.errors import GSIError
from gsi_jax.methods.evaluate import best_dense


# Paired decode rounds, dense beside GSI: enough for an interval, few enough for a demo.
TIMED_ROUNDS = 7


def run_demo(config: experiment.ExperimentConfig, prompt: str) -> dict:
  if len(config.k) != 1 or len(config.eps) != 1:
    raise GSIError("the demo takes one --k and one --eps")
  if not prompt.strip():
    raise GSIError("--prompt is empty")
  k, eps = config.k[0], config.eps[0]
  t0 = time.perf_counter()
  s = experiment.prepare(config)
  setup_s = time.perf_counter() - t0
  model = s.model
  params = gsi_jax.apply_gsi(model.params, s.bases, k)
  ids = model.encode(prompt)[None]
  n = config.max_new_tokens
  gate = gsi_jax.make_gate(eps, impl=config.impl, batch1_switch=True)
  with progress.step(f"generating up to {n} tokens, dense then GSI (compiling each)"):
    dense_ids, gsi_ids = (np.asarray(model.generate(p, ids, n, g))
                          for p, g in ((model.params, None), (params, gate)))
  # GSI is timed beside the faster dense decode: XLA's dot, or on CPU the kept-rows kernel
  # keeping every row, which decodes faster than XLA's by itself.
  dense_path, dense_tree, dense_choice = best_dense(model, model.params, ids, n, TIMED_ROUNDS)
  with progress.step(f"timing {n}-token decodes, GSI beside dense ({dense_path}) in "
                     f"{TIMED_ROUNDS} rounds"):
    timed = benchmarking.decode_beside(model, ids, n, TIMED_ROUNDS, params, gate, *dense_tree)
  _, decode_stats = model.generate(params, ids, n, gate, return_stats=True)
  decode_share = decode_stats["fast_share_by_layer"]
  decode_bytes = metrics.byte_accounting(params, decode_share, decode_stats["rows_by_layer"])

  with progress.step(f"scoring {s.held_out.n_tokens} held-out tokens, dense then GSI"):
    dense_scores = metrics.score(model, model.params, s.held_out.ids)
    gsi_scores = metrics.score(model, params, s.held_out.ids,
                               gsi_jax.make_gate(eps, impl=config.impl))
  quality = metrics.quality(dense_scores, gsi_scores)
  eval_bytes = metrics.byte_accounting(params, gsi_scores["fast_share_by_layer"])
  T = ids.shape[1]
  return {
      "model": model.config.name, "device": provenance.device_text(), "k": k, "eps": eps,
      "impl": config.impl, "prompt": prompt,
      "dense_text": model.decode(dense_ids[0, T:]), "gsi_text": model.decode(gsi_ids[0, T:]),
      "identical": bool(np.array_equal(dense_ids, gsi_ids)),
      "dense_new_tokens": int(dense_ids.shape[1] - T), "gsi_new_tokens": int(gsi_ids.shape[1] - T),
      "decode_fast_share": metrics.mean_share(decode_share),
      "decode_speedup_paper": decode_bytes["speedup_paper"],
      "decode_speedup_bytes": decode_bytes["speedup_bytes"],
      "best_dense": dense_path, "best_dense_choice": dense_choice,
      "dense_tokens_per_s": timed["dense_tokens_per_s"], "gsi_tokens_per_s": timed["tokens_per_s"],
      **{key: timed[key] for key in ("measured_speedup", "speedup_low", "speedup_high", "rounds",
                                     "dense_spread", "verdict")},
      "setup_s": setup_s, "gsi_compile_s": timed["compile_s"],
      "calibration": s.calib.describe(), "evaluation": s.held_out.describe(),
      **{key: quality[key] for key in ("ppl_dense", "ppl", "ppl_ratio", "top1_agreement",
                                       "fast_share", "fast_share_by_site")},
      "eval_speedup_paper": eval_bytes["speedup_paper"],
      "eval_speedup_bytes": eval_bytes["speedup_bytes"],
      "storage_overhead": eval_bytes["storage_overhead"],
  }


def report(r: dict) -> str:
  c, e = r["calibration"], r["evaluation"]
  return "\n".join([
      f"\n== {r['model']}: GSI k={r['k']}, eps={r['eps']} ({r['impl']}), on {r['device']} ==",
      f"prompt: {r['prompt']!r}",
      f"dense : {r['dense_text']!r}",
      f"GSI   : {r['gsi_text']!r}",
      f"identical: {r['identical']}",
      f"decode fast-path share: {r['decode_fast_share']:.1%}",
      f"speedup on weight reads: paper formula {r['decode_speedup_paper']:.2f}x, "
      f"true bytes per token {r['decode_speedup_bytes']:.2f}x",
      f"measured decode: dense ({r['best_dense']}) {r['dense_tokens_per_s']:.1f} tok/s, GSI "
      f"{r['gsi_tokens_per_s']:.1f} tok/s, " + benchmarking.ratio_text(
          r["measured_speedup"], r["speedup_low"], r["speedup_high"])
      + f" over {r['rounds']} paired rounds ({r['verdict']})",
      f"held-out text ({e['source']}, {e['tokens']} tokens; calibrated on {c['source']}, "
      f"{c['tokens']} tokens):",
      f"  perplexity dense {r['ppl_dense']:.3f}, GSI {r['ppl']:.3f}, ratio {r['ppl_ratio']:.4f}",
      f"  top-1 agreement {r['top1_agreement']:.2%}, fast-path share {r['fast_share']:.1%} "
      f"({', '.join(f'{s} {v:.1%}' for s, v in r['fast_share_by_site'].items())})",
      f"  speedup: paper formula {r['eval_speedup_paper']:.2f}x, true bytes "
      f"{r['eval_speedup_bytes']:.2f}x; M and V_k add {r['storage_overhead']:.1%} to the model",
  ])


def main(argv):
  text.text_flag("--prompt", flags.FLAGS.prompt)
  config = cli.experiment_config(default_out="")
  result = run_demo(config, flags.FLAGS.prompt)
  print(report(result))
  if config.out:
    experiment.write_json(config.out, result)


if __name__ == "__main__":
  cli.define_experiment_flags(k=["256"], eps=["0.1"], eval_tokens=4096)
  flags.DEFINE_string("prompt", "The Python interpreter reads a program and",
                      "Prompt for greedy generation.")
  cli.run(main)
