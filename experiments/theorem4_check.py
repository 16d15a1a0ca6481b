"""Theorem 4 on real activations: how tight ‖W r‖ ≤ ‖W‖₂ ε ‖x‖ is on fast tokens.

  python experiments/theorem4_check.py --k 256 --eps 0.1,0.2 --eval_tokens 2048

The bound follows from the gate itself, so its violation count checks the
implementation (float rounding), not the theorem; the tightness is the result.
"""

import logging

import gsi_jax
from gsi_jax import cli, experiment, metrics
from gsi_jax.experiment import ExperimentConfig

cli.define_experiment_flags()
OUT = "results/theorem4_check.json"
COLUMNS = ["k", "eps", "fast_map_tokens", "violations", "median_error_over_bound",
           "max_error_over_bound", "median_error_over_norm_r", "max_error_over_norm_r"]


def theorem4_check(config: ExperimentConfig) -> tuple[experiment.Setup, list[dict]]:
  s = experiment.prepare(config)
  records = []
  for k in config.k:
    params = gsi_jax.apply_gsi(s.model.params, s.bases, k)
    for eps in config.eps:
      logging.info("k=%d eps=%g", k, eps)
      records.append({"k": k, **metrics.theorem4_tightness(s.model, params, s.held_out.ids, eps),
                      "eval_tokens": s.held_out.n_tokens})
  return s, records


def main(argv):
  config = cli.experiment_config(OUT)
  s, records = theorem4_check(config)
  experiment.write_records(config.out, s.describe(), records, COLUMNS)


if __name__ == "__main__":
  cli.run(main)
