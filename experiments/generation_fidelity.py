"""Greedy generation, dense vs GSI: identical text or not, and where it diverges.

  python experiments/generation_fidelity.py --k 256 --eps 0.05,0.1 --max_new_tokens 50
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
OUT = "results/generation_fidelity.json"


def first_divergence(a: str, b: str) -> int | None:
  """Index of the first differing character, None when identical."""
  if a == b:
    return None
  n = min(len(a), len(b))
  return next((i for i in range(n) if a[i] != b[i]), n)


def main(argv):
  ks, epsilons, prompts = harness.ks(), harness.epsilons(), harness.prompts()
  s = harness.setup(k_max=max(ks), need_eval=False)
  model, n = s.model, FLAGS.max_new_tokens
  dense = {}
  for p in prompts:
    ids = model.encode(p)[None]
    dense[p] = model.decode(np.asarray(model.generate(model.params, ids, n))[0, ids.shape[1]:])
  records = []
  for k in ks:
    params = gsi_jax.apply_gsi(model.params, s.bases, k)
    for eps in epsilons:
      logging.info("k=%d eps=%g", k, eps)
      for p in prompts:
        ids = model.encode(p)[None]
        out, share = model.generate(params, ids, n, gsi_jax.make_gate(eps, skip_residual=True),
                                    return_stats=True)
        text = model.decode(np.asarray(out)[0, ids.shape[1]:])
        div = first_divergence(dense[p], text)
        records.append({"k": k, "eps": eps, "prompt": p, "dense_text": dense[p],
                        "gsi_text": text, "identical": div is None, "first_divergence": div,
                        "fast_share": metrics.mean_share(share), "new_tokens": n})
  out = harness.write(harness.config(s), records,
                      ["k", "eps", "prompt", "identical", "first_divergence", "fast_share"], OUT)
  fig, ax = plt.subplots(figsize=(7, 4))
  for k in ks:
    rows = [r for r in records if r["k"] == k]
    ax.plot([r["eps"] for r in rows],
            [len(r["dense_text"]) if r["first_divergence"] is None else r["first_divergence"]
             for r in rows], "o", label=f"k={k}", alpha=0.7)
  ax.set(xlabel="eps", ylabel="characters identical to dense", title=model.config.name)
  ax.legend()
  harness.save_figure(fig, out)


if __name__ == "__main__":
  cli.run(main)
