"""The paper's negative control: static projection (eps = inf) against the gate, same k.

  python experiments/negative_control.py --k 128 --eps 0.05,0.1
"""

import logging

import matplotlib.pyplot as plt
import numpy as np

import gsi_jax
from gsi_jax import cli, experiment, metrics
from gsi_jax.experiment import ExperimentConfig

cli.define_experiment_flags()
OUT = "results/negative_control.json"
COLUMNS = ["k", "mode", "eps", "ppl_ratio", "top1_agreement", "fast_share",
           "generations_identical", "prompts"]


def negative_control(config: ExperimentConfig):
  s = experiment.prepare(config)
  model, n = s.model, config.max_new_tokens
  dense = metrics.score(model, model.params, s.held_out.ids)
  generate = lambda params, p, gate=None: np.asarray(
      model.generate(params, model.encode(p)[None], n, gate))
  dense_gen = {p: generate(model.params, p) for p in config.prompts}
  records = []
  for k in config.k:
    params = gsi_jax.apply_gsi(model.params, s.bases, k)
    for mode, eps in [("static", None)] + [("gated", e) for e in config.eps]:
      logging.info("k=%d %s eps=%s", k, mode, eps)
      gate = gsi_jax.make_gate(eps or 0.0, mode, impl=config.impl)
      q = metrics.quality(dense, metrics.score(model, params, s.held_out.ids, gate))
      same = [np.array_equal(dense_gen[p], generate(params, p, gate)) for p in config.prompts]
      records.append({"k": k, "mode": mode, "eps": eps, **q,
                      "generations_identical": int(sum(same)), "prompts": len(config.prompts),
                      "calib_tokens": s.calib.n_tokens, "eval_tokens": s.held_out.n_tokens})
  return s, records


def plot(records, title, out):
  fig, ax = plt.subplots(figsize=(7, 4))
  labels = [f"k={r['k']} {r['mode']}" + ("" if r["eps"] is None else f" eps={r['eps']}")
            for r in records]
  ax.bar(range(len(records)), [r["ppl_ratio"] for r in records],
         color=["tab:red" if r["mode"] == "static" else "tab:blue" for r in records])
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xticks(range(len(records)), labels, rotation=30, ha="right", fontsize=8)
  ax.set(ylabel="perplexity ratio (GSI / dense)", yscale="log",
         title=f"{title}: static (red) vs gated (blue)")
  experiment.save_figure(fig, out)


def main(argv):
  config = cli.experiment_config(OUT)
  s, records = negative_control(config)
  experiment.write_records(config.out, s.describe(), records, COLUMNS)
  plot(records, s.model.config.name, config.out)


if __name__ == "__main__":
  cli.run(main)
