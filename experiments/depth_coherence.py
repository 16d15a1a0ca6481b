"""Similarity of consecutive layers' subspaces, per site (mean principal cosine).

  python experiments/depth_coherence.py --k 256
"""

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from absl import flags

import numpy as np

import gsi_jax
from gsi_jax import cli, harness
from gsi_jax.gsi.coherence import principal_cosines

FLAGS = flags.FLAGS
OUT = "results/depth_coherence.json"


def random_baseline(bases, site, k, seed=0) -> float:
  """The same statistic for two random k-dim subspaces of the site's width: the floor."""
  d = next(v[site] for v in bases.vectors.values() if site in v).shape[0]
  k = min(k, d)
  rng = np.random.default_rng(seed)
  A, _ = np.linalg.qr(rng.normal(size=(d, k)))
  B, _ = np.linalg.qr(rng.normal(size=(d, k)))
  return float(principal_cosines(A, B).mean())


def main(argv):
  ks = harness.ks()
  s = harness.setup(k_max=max(ks), need_eval=False)
  records = []
  for k in ks:
    for site, values in gsi_jax.depth_coherence(s.bases, k).items():
      for layer, v in enumerate(values):
        records.append({"k": k, "site": site, "layer": layer, "next_layer": layer + 1,
                        "mean_cosine": v})
  summary = {}
  for r in records:
    summary.setdefault((r["k"], r["site"]), []).append(r["mean_cosine"])
  table = [{"k": k, "site": site, "mean_over_layers": sum(v) / len(v),
            "deeper_half_mean": sum(v[len(v) // 2:]) / len(v[len(v) // 2:]), "min": min(v),
            "random_subspaces": random_baseline(s.bases, site, k)}
           for (k, site), v in summary.items()]
  out = harness.write(harness.config(s, summary=table), records,
                      ["k", "site", "layer", "next_layer", "mean_cosine"], OUT)
  print(harness.markdown_table(table, ["k", "site", "mean_over_layers", "deeper_half_mean",
                                       "min", "random_subspaces"]))
  fig, ax = plt.subplots(figsize=(7, 4))
  for (k, site), v in summary.items():
    ax.plot(range(len(v)), v, "o-", ms=3, label=f"{site} k={k}")
  ax.set(xlabel="layer l (vs l+1)", ylabel="mean cosine of principal angles",
         title=f"{s.model.config.name}: depth coherence", ylim=(0, 1))
  ax.legend(fontsize=7)
  harness.save_figure(fig, out)


if __name__ == "__main__":
  cli.run(main)
