"""GSI against its peers at equal bytes read: quality against true bytes per token.

  python experiments/pareto.py --k 128,256,384 --eps 0.05,0.1,0.2,0.5 --eval_tokens 4096

Methods: gsi (k × eps), static projection (k), activation-aware weight SVD
(rank), magnitude activation sparsity (target sparsity), and three
extensions beyond the paper: gsi_out (the output-aware gate
‖W r‖ < eps ‖W x‖, k × eps), gsi_ladder (nested ranks: the --ladder ranks
below k, then k; k × eps), head (the LM head gated at --head_k, dense
sites; --head_eps) and sparsity+head (both; sparsity × head_eps).  Bytes
count every weight each method reads per decoded token, the LM head and
embeddings included (`gsi_jax.metrics.bytes`).  One sweep per method.
"""

import dataclasses
import logging

import jax
import matplotlib.pyplot as plt
import numpy as np
from absl import flags

import gsi_jax
from gsi_jax import cli, experiment, metrics, peers
from gsi_jax.errors import GSIError
from gsi_jax.experiment import ExperimentConfig
from gsi_jax.gsi import calibration
from gsi_jax.metrics import bytes as mbytes

cli.define_experiment_flags()
flags.DEFINE_list("svd_ranks", ["32", "64", "128", "192", "256"], "Weight-SVD ranks.")
flags.DEFINE_list("sparsity", ["0.1", "0.25", "0.4", "0.5", "0.6", "0.7"],
                  "Magnitude-sparsity targets in [0, 1).")
flags.DEFINE_integer("output_sketch", 32, "Sketch columns of the output-aware gate (0: skip it).")
flags.DEFINE_list("ladder", ["64", "128", "256"], "Rank-ladder rungs (those below each k; "
                  "empty: skip the ladder).")
flags.DEFINE_integer("head_k", 384, "Rank of the gated LM head (0: skip it).")
flags.DEFINE_list("head_eps", ["0.1", "0.2"], "Gate thresholds of the LM head.")
FLAGS = flags.FLAGS
OUT = "results/pareto.json"
BUDGETS = (0.9, 0.75, 0.6, 0.5)
METHODS = ("gsi", "gsi_out", "gsi_ladder", "static", "svd", "sparsity", "head", "sparsity+head")
COLUMNS = ["method", "knob", "bytes_fraction", "ppl_ratio", "top1_agreement",
           "generations_identical"]


@dataclasses.dataclass(frozen=True)
class ParetoConfig:
  base: ExperimentConfig
  svd_ranks: tuple[int, ...]
  sparsity: tuple[float, ...]
  output_sketch: int
  ladder: tuple[int, ...]
  head_k: int
  head_eps: tuple[float, ...]

  def __post_init__(self):
    if any(r < 1 for r in self.svd_ranks):
      raise GSIError(f"--svd_ranks must be positive, got {list(self.svd_ranks)}")
    if any(not 0 <= s < 1 for s in self.sparsity):
      raise GSIError(f"--sparsity targets must lie in [0, 1), got {list(self.sparsity)}")
    if self.output_sketch < 0 or self.head_k < 0:
      raise GSIError("--output_sketch and --head_k must be >= 0")
    if any(r < 1 for r in self.ladder):
      raise GSIError(f"--ladder ranks must be positive, got {list(self.ladder)}")
    for e in self.head_eps:
      gsi_jax.ops.check_threshold("--head_eps values", e)


def config_from_flags() -> ParetoConfig:
  return ParetoConfig(
      base=cli.experiment_config(OUT),
      svd_ranks=cli.numbers("svd_ranks", FLAGS.svd_ranks, int),
      sparsity=cli.numbers("sparsity", FLAGS.sparsity, float),
      output_sketch=FLAGS.output_sketch,
      ladder=tuple(sorted(cli.numbers("ladder", FLAGS.ladder, int))) if FLAGS.ladder else (),
      head_k=FLAGS.head_k, head_eps=cli.numbers("head_eps", FLAGS.head_eps, float))


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


class Evaluator:
  """Scores a parameter tree on the held-out text and greedy generations, against dense."""

  def __init__(self, s: experiment.Setup):
    self.s, self.model = s, s.model
    self.dense = metrics.score(s.model, s.model.params, s.held_out.ids)
    self.dense_bytes = mbytes.dense_bytes(s.model.params)
    self.dense_gen = {p: self._generate(s.model.params, p) for p in s.config.prompts}

  def _generate(self, params, prompt, gate=None):
    return np.asarray(self.model.generate(params, self.model.encode(prompt)[None],
                                          self.s.config.max_new_tokens, gate))

  def record(self, method, knob, params, gate, bytes_of):
    """bytes_of(scores) -> weight bytes per token (some methods' bytes depend on the text)."""
    scores = metrics.score(self.model, params, self.s.held_out.ids, gate)
    q = metrics.quality(self.dense, scores)
    bytes_per_token = bytes_of(scores)
    same = sum(np.array_equal(g, self._generate(params, p, gate))
               for p, g in self.dense_gen.items())
    logging.info("%s %s: bytes %.3f, ppl ratio %.4f", method, knob,
                 bytes_per_token / self.dense_bytes, q["ppl_ratio"])
    return {"method": method, "knob": knob, "bytes_per_token": bytes_per_token,
            "bytes_fraction": bytes_per_token / self.dense_bytes, "ppl_ratio": q["ppl_ratio"],
            "top1_agreement": q["top1_agreement"], "fast_share": q["fast_share"],
            "head_fast_share": scores["head_fast_share"],
            "generations_identical": int(same), "prompts": len(self.dense_gen)}


def release_executables():
  """Each parameter tree's structure compiles its own score and decode programs; a sweep
  over dozens of them failed in XLA's compiler ("Cannot allocate memory") unless they
  are dropped as it goes."""
  jax.clear_caches()


def gated_bytes(params):
  return lambda sc: metrics.byte_accounting(params, sc["fast_share_by_layer"],
                                            sc["rows_by_layer"])["bytes_per_token"]


def sweep_gsi(ev, c: ParetoConfig, method: str, variant) -> list[dict]:
  """gsi, gsi_out or gsi_ladder: variant(k) -> params (None: skip that k)."""
  records = []
  for k in c.base.k:
    params = variant(k)
    if params is None:
      continue
    for eps in c.base.eps:
      gate = gsi_jax.make_gate(eps, impl=c.base.impl)
      records.append(ev.record(method, f"k={k},eps={eps}", params, gate, gated_bytes(params)))
  release_executables()
  return records


def sweep_static(ev, c: ParetoConfig) -> list[dict]:
  records = []
  for k in c.base.k:
    params = gsi_jax.apply_gsi(ev.model.params, ev.s.bases, k)
    records.append(ev.record("static", f"k={k}", params,
                             gsi_jax.make_gate(0.0, "static", impl=c.base.impl),
                             gated_bytes(params)))
  release_executables()
  return records


def sweep_svd(ev, c: ParetoConfig) -> list[dict]:
  base = ev.model.params
  svds = peers.whitened_svds(base, calibration.gram_matrices(ev.model, base, ev.s.calib.ids,
                                                              progress=False))
  records = [ev.record("svd", f"rank={rank}", peers.svd_truncate(base, svds, rank), None,
                       lambda sc, r=rank: mbytes.svd_bytes(base, r)) for rank in c.svd_ranks]
  release_executables()
  return records


def sparse_params(ev, c: ParetoConfig) -> dict:
  base = ev.model.params
  return {sp: peers.apply_sparsity(base, peers.sparsity_thresholds(ev.model, base,
                                                                   ev.s.calib.ids, sp))
          for sp in c.sparsity}


def sparse_bytes(params):
  return lambda sc: mbytes.sparsity_bytes(params, sc["kept_share_by_layer"],
                                          sc["head_fast_share"])


def sweep_sparsity(ev, c: ParetoConfig, sparse: dict) -> list[dict]:
  records = [ev.record("sparsity", f"target={sp}", params, None, sparse_bytes(params))
             for sp, params in sparse.items()]
  release_executables()
  return records


def sweep_head(ev, c: ParetoConfig, sparse: dict) -> list[dict]:
  """The gated LM head alone (dense sites), then on top of each sparsity level."""
  V_head, _, _ = gsi_jax.head_basis(ev.model, ev.model.params, ev.s.calib.ids, c.head_k)
  records = []
  for head_eps in c.head_eps:
    gate = gsi_jax.make_gate(0.0, head_eps=head_eps, impl=c.base.impl)  # sites stay dense
    head_only = gsi_jax.apply_gsi_head(ev.model.params, V_head, c.head_k)
    records.append(ev.record("head", f"head_k={c.head_k},head_eps={head_eps}", head_only, gate,
                             sparse_bytes(head_only)))
    for sp, params in sparse.items():
      both = gsi_jax.apply_gsi_head(params, V_head, c.head_k)
      records.append(ev.record("sparsity+head", f"target={sp},head_eps={head_eps}", both, gate,
                               sparse_bytes(both)))
  release_executables()
  return records


def pareto(c: ParetoConfig):
  s = experiment.prepare(c.base)
  ev = Evaluator(s)
  base = s.model.params
  records = sweep_gsi(ev, c, "gsi", lambda k: gsi_jax.apply_gsi(base, s.bases, k))
  if c.output_sketch:
    records += sweep_gsi(ev, c, "gsi_out",
                         lambda k: gsi_jax.apply_gsi(base, s.bases, k, c.output_sketch))
  if c.ladder:
    records += sweep_gsi(ev, c, "gsi_ladder", lambda k: gsi_jax.apply_gsi(
        base, s.bases, k, ladder=[r for r in c.ladder if r < k]) if c.ladder[0] < k else None)
  records += sweep_static(ev, c) + sweep_svd(ev, c)
  sparse = sparse_params(ev, c)
  records += sweep_sparsity(ev, c, sparse)
  if c.head_k:
    records += sweep_head(ev, c, sparse)
  budgets = []
  for budget in BUDGETS:
    row = {"budget": budget}
    for method in METHODS:
      mine = [r for r in records if r["method"] == method]
      row[f"{method}_ppl_ratio"] = frontier_at(mine, budget, "ppl_ratio")
      row[f"{method}_top1"] = frontier_at(mine, budget, "top1_agreement")
    budgets.append(row)
  return s, ev, records, budgets


def plot(records, out):
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  markers = dict(zip(METHODS, "oDPs^vXh"))
  for method in METHODS:
    mine = sorted((r for r in records if r["method"] == method),
                  key=lambda r: r["bytes_fraction"])
    if not mine:
      continue
    # Swept over two knobs (k × eps): points, not a line.
    ls = "none" if method.startswith("gsi") or method == "sparsity+head" else "-"
    for ax, key in zip(axes, ("ppl_ratio", "top1_agreement")):
      ax.plot([r["bytes_fraction"] for r in mine], [r[key] for r in mine], markers[method],
              label=method, ls=ls, alpha=0.8)
  axes[0].set(xlabel="weight bytes per token / dense", ylabel="perplexity ratio", yscale="log")
  axes[1].set(xlabel="weight bytes per token / dense", ylabel="top-1 agreement")
  for ax in axes:
    ax.axvline(1.0, color="gray", lw=0.8)
  axes[1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
  experiment.save_figure(fig, out)


def main(argv):
  c = config_from_flags()
  s, ev, records, budgets = pareto(c)
  extra = {"budgets": budgets, "dense_bytes_per_token": ev.dense_bytes,
           **{f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "base"}}
  experiment.write_records(c.base.out, s.describe(**extra), records, COLUMNS)
  print(experiment.markdown_table(budgets, list(budgets[0])))
  plot(records, c.base.out)


if __name__ == "__main__":
  cli.run(main)
