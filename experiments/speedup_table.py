"""Fast-path share and weight-read speedup (paper formula and true bytes) over k x eps.

  python experiments/speedup_table.py --k 128,256,384 --eps 0.05,0.1,0.2
"""

import logging

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from absl import flags

import gsi_jax
from gsi_jax import cli, harness
from gsi_jax.gsi import metrics

FLAGS = flags.FLAGS
OUT = "results/speedup_table.json"


def main(argv):
  ks, epsilons = harness.ks(), harness.epsilons()
  s = harness.setup(k_max=max(ks))
  dense_bytes = metrics.byte_accounting(s.model.params, None, None)
  records = []
  for k in ks:
    params = gsi_jax.apply_gsi(s.model.params, s.bases, k)
    for eps in epsilons:
      logging.info("k=%d eps=%g", k, eps)
      scores = metrics.score(s.model, params, s.held_out.ids, gsi_jax.make_gate(eps))
      share = scores["fast_share_by_layer"]
      b = metrics.byte_accounting(params, k, share)
      records.append({
          "k": k, "eps": eps, "fast_share": metrics.mean_share(share),
          "fast_share_by_site": metrics.share_by_site(share),
          "speedup_paper": b["speedup_paper"], "speedup_linear_bytes": b["speedup_linear_bytes"],
          "speedup_bytes": b["speedup_bytes"], "bytes_per_token": b["bytes_per_token"],
          "bytes_per_token_dense": b["bytes_per_token_dense"],
          "effective_params": b["effective_params"],
          "effective_params_paper": b["effective_params_paper"],
          "params_total": dense_bytes["params_total"],
          "calib_tokens": s.calib.n_tokens, "eval_tokens": s.held_out.n_tokens})
  out = harness.write(harness.config(s), records,
                      ["k", "eps", "fast_share", "speedup_paper", "speedup_linear_bytes",
                       "speedup_bytes", "effective_params", "effective_params_paper"], OUT)
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for k in ks:
    rows = [r for r in records if r["k"] == k]
    axes[0].plot([r["eps"] for r in rows], [r["fast_share"] for r in rows], "o-", label=f"k={k}")
    axes[1].plot([r["eps"] for r in rows], [r["speedup_paper"] for r in rows], "o--",
                 label=f"k={k} paper formula")
    axes[1].plot([r["eps"] for r in rows], [r["speedup_bytes"] for r in rows], "s-",
                 label=f"k={k} true bytes")
  axes[0].set(xlabel="eps", ylabel="fast-path share", title=s.model.config.name)
  axes[1].axhline(1.0, color="gray", lw=0.8)
  axes[1].set(xlabel="eps", ylabel="speedup on weight reads", title="paper formula vs true bytes")
  for ax in axes:
    ax.legend(fontsize=7)
  harness.save_figure(fig, out)


if __name__ == "__main__":
  cli.run(main)
