"""Greedy generation, dense vs GSI: identical text or not, and where it diverges.

  python experiments/generation_fidelity.py --k 256 --eps 0.05,0.1 --max_new_tokens 50

Generation stops at the end-of-sequence token, as transformers' generate does;
two generations are identical only if they have the same tokens and length.
"""

import logging

import matplotlib.pyplot as plt
import numpy as np

import gsi_jax
from gsi_jax import cli, experiment, metrics
from gsi_jax.experiment import ExperimentConfig

cli.define_experiment_flags()
OUT = "results/generation_fidelity.json"
COLUMNS = ["k", "eps", "prompt", "identical", "first_divergence", "dense_tokens", "gsi_tokens",
           "fast_share"]


def first_divergence(a: str, b: str) -> int | None:
  """Index of the first differing character, None when identical."""
  if a == b:
    return None
  n = min(len(a), len(b))
  return next((i for i in range(n) if a[i] != b[i]), n)


def continuation(model, params, prompt, n, gate=None):
  """(new token ids, their text, decode fast shares) of a greedy generation."""
  ids = model.encode(prompt)[None]
  out, stats = model.generate(params, ids, n, gate, return_stats=True)
  new = np.asarray(out)[0, ids.shape[1]:]
  return new, model.decode(new), stats["fast_share_by_layer"]


def generation_fidelity(config: ExperimentConfig):
  s = experiment.prepare(config, need_eval=False)
  model, n = s.model, config.max_new_tokens
  dense = {p: continuation(model, model.params, p, n) for p in config.prompts}
  records = []
  for k in config.k:
    params = gsi_jax.apply_gsi(model.params, s.bases, k)
    for eps in config.eps:
      logging.info("k=%d eps=%g", k, eps)
      gate = gsi_jax.make_gate(eps, impl=config.impl, batch1_switch=True)
      for p in config.prompts:
        ids, text, share = continuation(model, params, p, n, gate)
        dense_ids, dense_text, _ = dense[p]
        same = len(ids) == len(dense_ids) and bool(np.all(ids == dense_ids))
        records.append({"k": k, "eps": eps, "prompt": p, "dense_text": dense_text,
                        "gsi_text": text, "identical": same,
                        "first_divergence": None if same else first_divergence(dense_text, text),
                        "dense_tokens": int(len(dense_ids)), "gsi_tokens": int(len(ids)),
                        "fast_share": metrics.mean_share(share), "max_new_tokens": n})
  return s, records


def plot(records, ks, title, out):
  """Characters identical to dense before the first difference; identical runs on top."""
  fig, ax = plt.subplots(figsize=(7, 4))
  top = max(len(r["dense_text"]) for r in records) * 1.08 + 1
  for i, k in enumerate(ks):
    rows = [r for r in records if r["k"] == k]
    shift = (i - (len(ks) - 1) / 2) * 0.004
    diverged = [r for r in rows if not r["identical"]]
    same = [r for r in rows if r["identical"]]
    line, = ax.plot([r["eps"] + shift for r in diverged],
                    [r["first_divergence"] for r in diverged], "o", alpha=0.7,
                    label=f"k={k} diverged")
    ax.plot([r["eps"] + shift for r in same], [top] * len(same), "*", ms=11,
            color=line.get_color(), label=f"k={k} identical")
  ax.axhline(top, color="gray", lw=0.5, ls=":")
  ax.set(xlabel="eps", ylabel="first differing character (identical: on top)", title=title)
  ax.legend(fontsize=7)
  experiment.save_figure(fig, out)


def main(argv):
  config = cli.experiment_config(OUT)
  s, records = generation_fidelity(config)
  experiment.write_records(config.out, s.describe(), records, COLUMNS)
  plot(records, config.k, s.model.config.name, config.out)


if __name__ == "__main__":
  cli.run(main)
