"""Fast-path share and weight-read speedup (paper formula and true bytes) over k × eps.

  python experiments/speedup_table.py --k 128,256,384 --eps 0.05,0.1,0.2
"""

import logging

import matplotlib.pyplot as plt

import gsi_jax
from gsi_jax import cli, experiment, metrics
from gsi_jax.experiment import ExperimentConfig

cli.define_experiment_flags()
OUT = "results/speedup_table.json"
COLUMNS = ["k", "eps", "fast_share", "speedup_paper", "speedup_linear_bytes", "speedup_bytes",
           "effective_params", "effective_params_paper", "linear_params_dense"]


def speedup_table(config: ExperimentConfig) -> tuple[experiment.Setup, list[dict]]:
  s = experiment.prepare(config)
  records = []
  for k in config.k:
    params = gsi_jax.apply_gsi(s.model.params, s.bases, k)
    for eps in config.eps:
      logging.info("k=%d eps=%g", k, eps)
      scores = metrics.score(s.model, params, s.held_out.ids,
                             gsi_jax.make_gate(eps, impl=config.impl))
      share = scores["fast_share_by_layer"]
      b = metrics.byte_accounting(params, share)
      records.append({
          "k": k, "eps": eps, "fast_share": metrics.mean_share(share),
          "fast_share_by_site": metrics.share_by_site(share),
          **{key: b[key] for key in (
              "speedup_paper", "speedup_linear_bytes", "speedup_bytes", "bytes_per_token",
              "bytes_per_token_dense", "effective_params", "effective_params_paper",
              "linear_params_dense", "params_total")},
          "calib_tokens": s.calib.n_tokens, "eval_tokens": s.held_out.n_tokens})
  return s, records


def plot(records, ks, title, out):
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for k in ks:
    rows = [r for r in records if r["k"] == k]
    axes[0].plot([r["eps"] for r in rows], [r["fast_share"] for r in rows], "o-", label=f"k={k}")
    axes[1].plot([r["eps"] for r in rows], [r["speedup_paper"] for r in rows], "o--",
                 label=f"k={k} paper formula")
    axes[1].plot([r["eps"] for r in rows], [r["speedup_bytes"] for r in rows], "s-",
                 label=f"k={k} true bytes")
  axes[0].set(xlabel="eps", ylabel="fast-path share", title=title)
  axes[1].axhline(1.0, color="gray", lw=0.8)
  axes[1].set(xlabel="eps", ylabel="speedup on weight reads", title="paper formula vs true bytes")
  for ax in axes:
    ax.legend(fontsize=7)
  experiment.save_figure(fig, out)


def main(argv):
  config = cli.experiment_config(OUT)
  s, records = speedup_table(config)
  experiment.write_records(config.out, s.describe(), records, COLUMNS)
  plot(records, config.k, s.model.config.name, config.out)


if __name__ == "__main__":
  cli.run(main)
