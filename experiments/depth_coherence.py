"""Similarity of consecutive layers' subspaces, per site (mean principal cosine).

  python experiments/depth_coherence.py --k 64,256
"""

import matplotlib.pyplot as plt
import numpy as np

from gsi_jax import cli, experiment, metrics
from gsi_jax.experiment import ExperimentConfig

cli.define_experiment_flags()
OUT = "results/depth_coherence.json"
COLUMNS = ["k", "site", "layer", "next_layer", "mean_cosine"]
SUMMARY = ["k", "site", "mean_over_layers", "deeper_half_mean", "min", "random_subspaces"]


def depth_coherence(config: ExperimentConfig):
  s = experiment.prepare(config, need_eval=False)
  records = [{"k": k, "site": site, "layer": layer, "next_layer": layer + 1, "mean_cosine": v}
             for k in config.k
             for site, values in metrics.depth_coherence(s.bases, k).items()
             for layer, v in enumerate(values)]
  widths = {site: V.shape[0] for sites in s.bases.vectors.values() for site, V in sites.items()}
  summary = []
  for k in config.k:
    for site in widths:
      v = [r["mean_cosine"] for r in records if r["k"] == k and r["site"] == site]
      summary.append({"k": k, "site": site, "mean_over_layers": float(np.mean(v)),
                      "deeper_half_mean": float(np.mean(v[len(v) // 2:])), "min": min(v),
                      "random_subspaces": metrics.random_subspace_cosine(widths[site], k)})
  return s, records, summary


def plot(summary, records, title, out):
  fig, ax = plt.subplots(figsize=(8, 4.5))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, row in enumerate(summary):
    v = [r["mean_cosine"] for r in records if r["k"] == row["k"] and r["site"] == row["site"]]
    color = colors[i % len(colors)]
    ax.plot(range(len(v)), v, "o-", ms=3, color=color, label=f"{row['site']} k={row['k']}")
    ax.axhline(row["random_subspaces"], color=color, ls=":", lw=1)
  ax.set(xlabel="layer l (vs l+1)", ylabel="mean cosine of principal angles", ylim=(0, 1),
         title=f"{title}: depth coherence (dotted: two random subspaces, the floor)")
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  experiment.save_figure(fig, out)


def main(argv):
  config = cli.experiment_config(OUT)
  s, records, summary = depth_coherence(config)
  experiment.write_records(config.out, s.describe(summary=summary), records, COLUMNS,
                           show=False)
  print(experiment.markdown_table(summary, SUMMARY))
  plot(summary, records, s.model.config.name, config.out)


if __name__ == "__main__":
  cli.run(main)
