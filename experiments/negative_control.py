"""The paper's negative control: static projection (eps = inf) against the gate, same k.

  python experiments/negative_control.py --k 128 --eps 0.05,0.1
"""

import logging

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from absl import flags

import gsi_jax
from gsi_jax import cli, harness
from gsi_jax.gsi import metrics

FLAGS = flags.FLAGS
OUT = "results/negative_control.json"


def main(argv):
  ks, epsilons, prompts = harness.ks(), harness.epsilons(), harness.prompts()
  s = harness.setup(k_max=max(ks))
  model, n = s.model, FLAGS.max_new_tokens
  dense = metrics.score(model, model.params, s.held_out.ids)
  dense_gen = {p: np.asarray(model.generate(model.params, model.encode(p)[None], n))
               for p in prompts}
  records = []
  for k in ks:
    params = gsi_jax.apply_gsi(model.params, s.bases, k)
    for mode, eps in [("static", None)] + [("gated", e) for e in epsilons]:
      logging.info("k=%d %s eps=%s", k, mode, eps)
      gate = gsi_jax.make_gate(eps or 0.0, mode)
      q = metrics.quality(dense, metrics.score(model, params, s.held_out.ids, gate))
      same = [np.array_equal(dense_gen[p], np.asarray(
          model.generate(params, model.encode(p)[None], n, gate))) for p in prompts]
      records.append({"k": k, "mode": mode, "eps": eps, **q,
                      "generations_identical": int(sum(same)), "prompts": len(prompts),
                      "calib_tokens": s.calib.n_tokens, "eval_tokens": s.held_out.n_tokens})
  out = harness.write(harness.config(s), records,
                      ["k", "mode", "eps", "ppl_ratio", "top1_agreement", "fast_share",
                       "generations_identical", "prompts"], OUT)
  fig, ax = plt.subplots(figsize=(7, 4))
  labels = [f"k={r['k']} {r['mode']}" + ("" if r["eps"] is None else f" eps={r['eps']}")
            for r in records]
  ax.bar(range(len(records)), [r["ppl_ratio"] for r in records],
         color=["tab:red" if r["mode"] == "static" else "tab:blue" for r in records])
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xticks(range(len(records)), labels, rotation=30, ha="right", fontsize=8)
  ax.set(ylabel="perplexity ratio (GSI / dense)", title=f"{model.config.name}: static vs gated")
  harness.save_figure(fig, out)


if __name__ == "__main__":
  cli.run(main)
