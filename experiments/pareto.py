"""GSI against its peers at equal bytes read: quality against true bytes per token.

  python experiments/pareto.py --k 128,256,384 --eps 0.05,0.1,0.2,0.5 --eval_tokens 4096

Methods: gsi (k x eps), static projection (k), activation-aware weight SVD
(rank), magnitude activation sparsity (target sparsity), and three
extensions beyond the paper: gsi_out (the output-aware gate
||W r|| < eps ||W x||, k x eps), gsi_ladder (nested ranks: the --ladder ranks
below k, then k; k x eps), head (the LM head gated at --head_k, dense
sites; --head_eps) and sparsity+head (both; sparsity x head_eps).  Bytes
count every weight each method reads per decoded token, the LM head and
embeddings included (a threshold is one scalar per site; a basis is d x k).
"""

import logging

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import jax
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
flags.DEFINE_list("ladder", ["64", "128", "256"], "Rank-ladder rungs (those below each k; "
                  "empty: skip the ladder).")
flags.DEFINE_integer("head_k", 384, "Rank of the gated LM head (0: skip it).")
flags.DEFINE_list("head_eps", ["0.1", "0.2"], "Gate thresholds of the LM head.")
OUT = "results/pareto.json"
BUDGETS = (0.9, 0.75, 0.6, 0.5)
METHODS = ("gsi", "gsi_out", "gsi_ladder", "static", "svd", "sparsity", "head", "sparsity+head")


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


def release_executables():
  """Each parameter tree's structure compiles its own score and decode programs; a sweep
  over dozens of them failed in XLA's compiler ("Cannot allocate memory") unless they
  are dropped as it goes."""
  jax.clear_caches()


def main(argv):
  ks, epsilons, prompts = harness.ks(), harness.epsilons(), harness.prompts()
  ranks = [int(r) for r in FLAGS.svd_ranks]
  sparsities = [float(s) for s in FLAGS.sparsity]
  rungs = sorted(int(r) for r in FLAGS.ladder)
  head_epsilons = [float(e) for e in FLAGS.head_eps]
  s = harness.setup(k_max=max(ks))
  model, n_new = s.model, FLAGS.max_new_tokens
  base = model.params
  dense = metrics.score(model, base, s.held_out.ids)
  other = metrics.other_elements(base)
  itemsize = model.dtype.itemsize
  dense_bytes = (metrics.linear_elements_dense(base) + other
                 + metrics.head_elements(base)) * itemsize
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
            "head_fast_share": scores["head_fast_share"],
            "generations_identical": int(same), "prompts": len(prompts)}

  records = []
  for k in ks:
    params = gsi_jax.apply_gsi(base, s.bases, k)
    variants = [("gsi", params)]
    if FLAGS.output_sketch:
      variants.append(("gsi_out", gsi_jax.apply_gsi(base, s.bases, k, FLAGS.output_sketch)))
    if [r for r in rungs if r < k]:
      variants.append(("gsi_ladder", gsi_jax.apply_gsi(base, s.bases, k,
                                                       ladder=[r for r in rungs if r < k])))
    for method, p in variants:
      gsi_bytes = lambda sc, p=p: metrics.byte_accounting(
          p, k, sc["fast_share_by_layer"], sc["rows_by_layer"])["bytes_per_token"]
      for eps in epsilons:
        records.append(record(method, f"k={k},eps={eps}", p, gsi_jax.make_gate(eps), gsi_bytes))
      release_executables()
    always_fast = {layer: {site: 1.0 for site in v} for layer, v in s.bases.vectors.items()}
    static_bytes = metrics.byte_accounting(params, k, always_fast)["bytes_per_token"]
    records.append(record("static", f"k={k}", params, gsi_jax.make_gate(0.0, "static"),
                          lambda sc: static_bytes))
  svds = peers.whitened_svds(base, calibration.gram_matrices(model, base, s.calib.ids,
                                                              progress=False))
  for rank in ranks:
    svd_bytes = (peers.svd_linear_elements(base, rank) + other
                 + metrics.head_elements(base)) * itemsize
    records.append(record("svd", f"rank={rank}", peers.svd_truncate(base, svds, rank), None,
                          lambda sc: svd_bytes))
  del svds  # float64 factors of every map
  release_executables()

  def sparse_bytes(params, sc):
    """Kept inputs' rows of every site, one threshold per site, and the head as it ran."""
    kept = sc["kept_share_by_layer"]
    lin = sum(kept.get(layer, {}).get(site, 1.0) * sum(W.size for W in ks_.values())
              for layer, sites in site_kernels(base).items() for site, ks_ in sites.items())
    thresholds = sum(len(v) for v in kept.values())
    head = metrics.head_elements(params, sc["head_fast_share"])
    return (lin + other + thresholds + head) * itemsize
  thresholds = {sp: peers.sparsity_thresholds(model, base, s.calib.ids, sp) for sp in sparsities}
  for sp in sparsities:
    params = peers.apply_sparsity(base, thresholds[sp])
    records.append(record("sparsity", f"target={sp}", params, None,
                          lambda sc, p=params: sparse_bytes(p, sc)))
  release_executables()
  if FLAGS.head_k:
    V_head, _, _ = gsi_jax.head_basis(model, base, s.calib.ids, FLAGS.head_k)
    head_only = gsi_jax.apply_gsi_head(base, V_head, FLAGS.head_k)
    for head_eps in head_epsilons:
      gate = gsi_jax.make_gate(0.0, head_eps=head_eps)  # sites without a basis stay dense
      records.append(record("head", f"head_k={FLAGS.head_k},head_eps={head_eps}", head_only,
                            gate, lambda sc: sparse_bytes(head_only, sc)))
      for sp in sparsities:
        params = gsi_jax.apply_gsi_head(peers.apply_sparsity(base, thresholds[sp]), V_head,
                                        FLAGS.head_k)
        records.append(record("sparsity+head", f"target={sp},head_eps={head_eps}", params,
                              gate, lambda sc, p=params: sparse_bytes(p, sc)))
  budgets = []
  for budget in BUDGETS:
    row = {"budget": budget}
    for method in METHODS:
      mine = [r for r in records if r["method"] == method]
      row[f"{method}_ppl_ratio"] = frontier_at(mine, budget, "ppl_ratio")
      row[f"{method}_top1"] = frontier_at(mine, budget, "top1_agreement")
    budgets.append(row)
  out = harness.write(harness.config(s, budgets=budgets, dense_bytes_per_token=dense_bytes),
                      records, ["method", "knob", "bytes_fraction", "ppl_ratio",
                                "top1_agreement", "generations_identical"], OUT)
  print(harness.markdown_table(budgets, list(budgets[0])))
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  markers = dict(zip(METHODS, "oDPs^vXh"))
  for method in METHODS:
    mine = sorted((r for r in records if r["method"] == method), key=lambda r: r["bytes_fraction"])
    if not mine:
      continue
    # Swept over two knobs (k x eps): points, not a line.
    ls = "none" if method.startswith("gsi") or method == "sparsity+head" else "-"
    for ax, key in zip(axes, ("ppl_ratio", "top1_agreement")):
      ax.plot([r["bytes_fraction"] for r in mine], [r[key] for r in mine], markers[method],
              label=method, ls=ls)
  axes[0].set(xlabel="weight bytes per token / dense", ylabel="perplexity ratio", yscale="log")
  axes[1].set(xlabel="weight bytes per token / dense", ylabel="top-1 agreement")
  for ax in axes:
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.legend()
  harness.save_figure(fig, out)


if __name__ == "__main__":
  cli.run(main)
