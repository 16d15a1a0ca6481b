"""Perplexity ratio, top-1 agreement and fast-path share over a k x eps grid.

  python experiments/quality_table.py --k 128,256,384 --eps 0.05,0.1,0.2 \
      --mode gated,static --out results/quality_table.json
"""

import logging

from absl import flags

import gsi_jax
from gsi_jax import cli, harness
from gsi_jax.gsi import metrics

FLAGS = flags.FLAGS


def main(argv):
  ks, epsilons, modes = harness.ks(), harness.epsilons(), harness.modes()
  s = harness.setup(k_max=max(ks))
  dense = metrics.score(s.model, s.model.params, s.held_out.ids)
  records = []
  for k in ks:
    params = gsi_jax.apply_gsi(s.model.params, s.bases, k)
    for mode in modes:
      for eps in (epsilons if mode == "gated" else [None]):
        logging.info("k=%d mode=%s eps=%s", k, mode, eps)
        scores = metrics.score(s.model, params, s.held_out.ids,
                               gsi_jax.make_gate(eps or 0.0, mode))
        q = metrics.quality(dense, scores)
        share = scores["fast_share_by_layer"] if mode != "dense" else {}
        b = metrics.byte_accounting(params, None if mode == "dense" else k, share)
        records.append({
            "k": k, "eps": eps, "mode": mode, **q,
            "speedup_paper": b["speedup_paper"], "speedup_bytes": b["speedup_bytes"],
            "bytes_fraction": b["bytes_fraction"],
            "calib_tokens": s.calib.n_tokens, "eval_tokens": s.held_out.n_tokens})
  harness.write(harness.config(s), records,
                ["k", "eps", "mode", "ppl_dense", "ppl", "ppl_ratio", "top1_agreement",
                 "fast_share", "speedup_paper", "speedup_bytes"],
                "results/quality_table.json")


if __name__ == "__main__":
  cli.run(main)
