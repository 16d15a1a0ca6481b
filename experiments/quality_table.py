"""Perplexity ratio, top-1 agreement and fast-path share over a k × eps grid.

  python experiments/quality_table.py --k 128,256,384 --eps 0.05,0.1,0.2 --mode gated,static
"""

import logging

import gsi_jax
from gsi_jax import cli, experiment, metrics
from gsi_jax.experiment import ExperimentConfig

cli.define_experiment_flags()
OUT = "results/quality_table.json"
COLUMNS = ["k", "eps", "mode", "ppl_dense", "ppl", "ppl_ratio", "top1_agreement", "fast_share",
           "speedup_paper", "speedup_bytes"]


def quality_table(config: ExperimentConfig) -> tuple[experiment.Setup, list[dict]]:
  s = experiment.prepare(config)
  model = s.model
  dense = metrics.score(model, model.params, s.held_out.ids)
  records = []
  for k in config.k:
    params = gsi_jax.apply_gsi(model.params, s.bases, k)
    for mode in config.mode:
      for eps in (config.eps if mode == "gated" else [None]):
        logging.info("k=%d mode=%s eps=%s", k, mode, eps)
        gate = gsi_jax.make_gate(eps or 0.0, mode, impl=config.impl)
        scores = metrics.score(model, params, s.held_out.ids, gate)
        b = metrics.byte_accounting(gsi_jax.dense_params(params) if mode == "dense" else params,
                                    scores["fast_share_by_layer"])
        records.append({
            "k": k, "eps": eps, "mode": mode, **metrics.quality(dense, scores),
            "speedup_paper": b["speedup_paper"], "speedup_bytes": b["speedup_bytes"],
            "bytes_fraction": b["bytes_fraction"],
            "calib_tokens": s.calib.n_tokens, "eval_tokens": s.held_out.n_tokens})
  return s, records


def main(argv):
  config = cli.experiment_config(OUT)
  s, records = quality_table(config)
  experiment.write_records(config.out, s.describe(), records, COLUMNS)


if __name__ == "__main__":
  cli.run(main)
