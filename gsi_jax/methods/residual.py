"""The subspace plus sparse residual (beyond the paper): y = g M + r_S W_S, r = x − V_k g
and S the residual's entries above a per-site threshold."""

from __future__ import annotations

import gsi_jax
from gsi_jax.errors import GSIError
from gsi_jax.methods.common import KEPT_ROWS, by_tree, in_unit, positive, sparse_bytes
from gsi_jax.methods.registry import Knob, Method, Point, register

RESIDUAL_K = Knob("residual_k", int, ("16", "32", "64", "128"),
                  "Ranks of the sparse-residual sweep.", check=positive("residual_k"))
RESIDUAL_SPARSITY = Knob("residual_sparsity", float, ("0.4", "0.5", "0.6", "0.7"),
                         "Target sparsities of the residual r = x - V_k g, in [0, 1).",
                         check=in_unit("residual_sparsity"))


def residual_thresholds(ctx, k, target):
  """The residual's |r| quantile per site at rank k, shared with the learned residuals."""
  return ctx.thresholds(target, ctx.gsi(k), key=("gsi", k))


def _points(ctx):
  keep_shares = ctx.runs("residual_learned") and ctx.grid["learned_sparsity"]
  for k in ctx.grid["residual_k"]:
    gsi_params = ctx.gsi(k)
    for sp in ctx.grid["residual_sparsity"]:
      shares = bool(keep_shares and k == ctx.grid["learned_residual_k"] and sp in keep_shares)
      yield Point(f"k={k},target={sp}", gsi_jax.apply_residual_sparsity(
          gsi_params, residual_thresholds(ctx, k, sp)), shares=shares)


def check_ranks(ranks, experiment):
  if max(ranks) > experiment.k_max:
    raise GSIError(f"--residual_k, --learned_residual_k and --learned_rank_max (up to "
                   f"{max(ranks)}) need bases of at least that rank; the largest --k is "
                   f"{experiment.k_max}")


RESIDUAL_PATH = {platform: f"g M through XLA; r_S W_S: {path}"
                 for platform, path in KEPT_ROWS.items()}
register(Method(
    "residual", "Subspace plus sparse residual: y = g M + r_S W_S.",
    (RESIDUAL_K, RESIDUAL_SPARSITY), _points, by_tree(sparse_bytes), RESIDUAL_PATH,
    check=lambda grid, experiment: check_ranks(grid["residual_k"], experiment)))
