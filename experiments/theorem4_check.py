"""Theorem 4 on real activations: ||W r|| <= ||W||_2 eps ||x|| on every fast token.

  python experiments/theorem4_check.py --k 256 --eps 0.1,0.2
"""

import logging

from absl import flags

import gsi_jax
from gsi_jax import cli, harness
from gsi_jax.gsi import metrics

FLAGS = flags.FLAGS
OUT = "results/theorem4_check.json"


def main(argv):
  ks, epsilons = harness.ks(), harness.epsilons()
  s = harness.setup(k_max=max(ks))
  records = []
  for k in ks:
    params = gsi_jax.apply_gsi(s.model.params, s.bases, k)
    for eps in epsilons:
      logging.info("k=%d eps=%g", k, eps)
      check = metrics.theorem4_check(s.model, params, s.held_out.ids, eps)
      records.append({"k": k, **check, "holds": check["violations"] == 0,
                      "eval_tokens": s.held_out.n_tokens})
  harness.write(harness.config(s), records,
                ["k", "eps", "fast_site_tokens", "violations", "max_error_over_bound",
                 "max_error_over_norm_r", "holds"], OUT)


if __name__ == "__main__":
  cli.run(main)
