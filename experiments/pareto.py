"""GSI against its peers at equal bytes read: quality against true bytes per token.

  python experiments/pareto.py --k 128,256,384 --eps 0.05,0.1,0.2,0.5,1.0

Methods: gsi (k x eps), gsi_out (the output-aware gate ||W r|| < eps ||W x||,
k x eps), static projection (k), activation-aware weight SVD (rank), magnitude
activation sparsity (target sparsity).  Bytes count every
weight each method reads per decoded token, the LM head and embeddings
included (a threshold is one scalar per site; a basis is d x k).
"""

import logging

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from absl import flags

import gsi_jax
from gsi_jax import cli, harness, peers
from gsi_jax.gsi import calibration, metrics
from gsi_jax.gsi.bases import site_kernels

FLAGS = flags.FLAGS
flags.DEFINE_list("svd_ranks", ["32", "64", "128", "192", "256"], "Weight-SVD ranks.")
flags.DEFINE_list("sparsity", ["0.1", "0.25", "0.4", "0.5", "0.6", "0.7"],
                  "Magnitude-sparsity targets.")
flags.DEFINE_integer("output_sketch", 32, "Sketch columns of the output-aware gate (0: skip it).")
OUT = "results/pareto.json"
BUDGETS = (0.9, 0.75, 0.6, 0.5)


def frontier_at(records, budget, key):
  """Quality at a bytes budget: linear interpolation along the method's Pareto front."""
  pts = sorted((r["bytes_fraction"], r[key]) for r in records)
  better = (lambda a, b: a < b) if key == "ppl_ratio" else (lambda a, b: a > b)
  front = []
  for b, q in pts:
    if not front or better(q, front[-1][1]):
      front.append((b, q))
  if not front or budget < front[0][0]:
    return None  # the method cannot get this cheap
  xs, ys = zip(*front)
  return float(np.interp(budget, xs, ys))


def main(argv):
  ks, epsilons, prompts = harness.ks(), harness.epsilons(), harness.prompts()
  ranks = [int(r) for r in FLAGS.svd_ranks]
  sparsities = [float(s) for s in FLAGS.sparsity]
  s = harness.setup(k_max=max(ks))
  model, n_new = s.model, FLAGS.max_new_tokens
  base = model.params
  dense = metrics.score(model, base, s.held_out.ids)
  dense_lin = metrics.linear_elements_dense(base)
  other = metrics.other_elements(base)
  itemsize = model.dtype.itemsize
  dense_bytes = (dense_lin + other) * itemsize
  dense_gen = {p: np.asarray(model.generate(base, model.encode(p)[None], n_new)) for p in prompts}

  def record(method, knob, params, gate, bytes_of):
    """bytes_of(scores) -> weight bytes per token (some methods' bytes depend on the text)."""
    scores = metrics.score(model, params, s.held_out.ids, gate)
    q = metrics.quality(dense, scores)
    bytes_per_token = bytes_of(scores)
    same = sum(np.array_equal(dense_gen[p], np.asarray(
        model.generate(params, model.encode(p)[None], n_new, gate))) for p in prompts)
    logging.info("%s %s: bytes %.3f, ppl ratio %.4f", method, knob,
                 bytes_per_token / dense_bytes, q["ppl_ratio"])
    return {"method": method, "knob": knob, "bytes_per_token": bytes_per_token,
            "bytes_fraction": bytes_per_token / dense_bytes, "ppl_ratio": q["ppl_ratio"],
            "top1_agreement": q["top1_agreement"], "fast_share": q["fast_share"],
            "generations_identical": int(same), "prompts": len(prompts)}

  records = []
  for k in ks:
    params = gsi_jax.apply_gsi(base, s.bases, k)
    variants = [("gsi", params)]
    if FLAGS.output_sketch:
      variants.append(("gsi_out", gsi_jax.apply_gsi(base, s.bases, k, FLAGS.output_sketch)))
    for method, p in variants:
      gsi_bytes = lambda sc, p=p: metrics.byte_accounting(
          p, k, sc["fast_share_by_layer"])["bytes_per_token"]
      for eps in epsilons:
        records.append(record(method, f"k={k},eps={eps}", p, gsi_jax.make_gate(eps), gsi_bytes))
    always_fast = {layer: {site: 1.0 for site in v} for layer, v in s.bases.vectors.items()}
    static_bytes = metrics.byte_accounting(params, k, always_fast)["bytes_per_token"]
    records.append(record("static", f"k={k}", params, gsi_jax.make_gate(0.0, "static"),
                          lambda sc: static_bytes))
  svds = peers.whitened_svds(base, calibration.gram_matrices(model, base, s.calib.ids,
                                                              progress=False))
  for rank in ranks:
    svd_bytes = (peers.svd_linear_elements(base, rank) + other) * itemsize
    records.append(record("svd", f"rank={rank}", peers.svd_truncate(base, svds, rank), None,
                          lambda sc: svd_bytes))

  def sparse_bytes(sc):
    kept = sc["kept_share_by_layer"]
    lin = sum(kept[layer][site] * sum(W.size for W in ks_.values())
              for layer, sites in site_kernels(base).items() for site, ks_ in sites.items())
    thresholds = sum(len(v) for v in kept.values())  # one scalar per site
    return (lin + other + thresholds) * itemsize
  for sp in sparsities:
    params = peers.apply_sparsity(base, peers.sparsity_thresholds(model, base, s.calib.ids, sp))
    records.append(record("sparsity", f"target={sp}", params, None, sparse_bytes))
  budgets = []
  for budget in BUDGETS:
    row = {"budget": budget}
    for method in ("gsi", "gsi_out", "static", "svd", "sparsity"):
      mine = [r for r in records if r["method"] == method]
      row[f"{method}_ppl_ratio"] = frontier_at(mine, budget, "ppl_ratio")
      row[f"{method}_top1"] = frontier_at(mine, budget, "top1_agreement")
    budgets.append(row)
  out = harness.write(harness.config(s, budgets=budgets, dense_bytes_per_token=dense_bytes),
                      records, ["method", "knob", "bytes_fraction", "ppl_ratio",
                                "top1_agreement", "generations_identical"], OUT)
  print(harness.markdown_table(budgets, list(budgets[0])))
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for method, marker in (("gsi", "o"), ("gsi_out", "D"), ("static", "s"), ("svd", "^"),
                         ("sparsity", "v")):
    mine = sorted((r for r in records if r["method"] == method), key=lambda r: r["bytes_fraction"])
    axes[0].plot([r["bytes_fraction"] for r in mine], [r["ppl_ratio"] for r in mine], marker,
                 label=method, ls="none" if method.startswith("gsi") else "-")
    axes[1].plot([r["bytes_fraction"] for r in mine], [r["top1_agreement"] for r in mine],
                 marker, label=method, ls="none" if method.startswith("gsi") else "-")
  axes[0].set(xlabel="weight bytes per token / dense", ylabel="perplexity ratio", yscale="log")
  axes[1].set(xlabel="weight bytes per token / dense", ylabel="top-1 agreement")
  for ax in axes:
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.legend()
  harness.save_figure(fig, out)


if __name__ == "__main__":
  cli.run(main)
