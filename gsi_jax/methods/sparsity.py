"""Magnitude activation sparsity and its allocations: sparsity (TEAL-style, one |x|
quantile per site), larosa (the same on inputs rotated into their PCA basis) and
sparsity_greedy (TEAL's block-wise greedy levels per site)."""

from __future__ import annotations

from gsi_jax import peers
from gsi_jax.peers import greedy_sparsity
from gsi_jax.methods.common import KEPT_ROWS, by_tree, in_unit, sparse_bytes
from gsi_jax.methods.registry import Knob, Method, Point, register
from gsi_jax.models import params as P

SPARSITY = Knob("sparsity", float, ("0.1", "0.25", "0.4", "0.5", "0.6", "0.7"),
                "Magnitude-sparsity targets in [0, 1).", check=in_unit("sparsity"))
LAROSA_SITES = Knob("larosa_sites", str, ("attn_in", "mlp_in"), "Sites LaRoSA rotates "
                    "(empty: skip it); the rest stay plain magnitude sparsity.",
                    check=lambda v: None if set(v) <= set(P.SITES) else
                    f"--larosa_sites: unknown sites {sorted(set(v) - set(P.SITES))}; "
                    f"choose from {P.SITES}", may_be_empty=True)
GREEDY_SPARSITY = Knob("greedy_sparsity", float, ("0.4", "0.5", "0.6"),
                       "Layer sparsity targets of TEAL's greedy allocation, in (0, 1).",
                       check=in_unit("greedy_sparsity", closed_low=False))
GREEDY_STEP = Knob("greedy_step", float, 0.02, "Layer sparsity added per greedy step.",
                   check=lambda v: None if 0 < v < 1 else
                   f"--greedy_step must lie in (0, 1), got {v}", many=False)
GREEDY_WINDOWS = Knob("greedy_windows", int, 2, "Calibration windows the greedy block errors "
                      "use.", check=lambda v: None if v >= 1 else
                      f"--greedy_windows must be >= 1, got {v}", many=False)


def sparse_tree(ctx, target):
  """The base tree with every site's threshold at the target's |x| quantile."""
  return peers.apply_sparsity(ctx.base, ctx.thresholds(target))


def _sparsity_points(ctx):
  keep_shares = ctx.runs("sparsity_learned") and ctx.grid["learned_sparsity"]
  for sp in ctx.grid["sparsity"]:
    yield Point(f"target={sp}", sparse_tree(ctx, sp), shares=bool(
        keep_shares and sp in keep_shares))


def _larosa_points(ctx):
  rotated = peers.apply_rotation(ctx.base, peers.pca_bases(ctx.grams(),
                                                           ctx.grid["larosa_sites"]))
  for sp in ctx.grid["sparsity"]:
    yield Point(f"target={sp}", peers.apply_sparsity(
        rotated, ctx.thresholds(sp, rotated, key="larosa")))


def _greedy_points(ctx):
  config = greedy_sparsity.GreedyConfig(step=ctx.grid["greedy_step"],
                                        windows=ctx.grid["greedy_windows"])
  thresholds, levels = greedy_sparsity.greedy_allocation(
      ctx.model, ctx.base, ctx.calib_ids, ctx.grid["greedy_sparsity"], config)
  for sp in ctx.grid["greedy_sparsity"]:
    yield Point(f"target={sp}", peers.apply_sparsity(ctx.base, thresholds[sp]), shares=True,
                extra={"allocation": levels[sp]})


register(Method(
    "sparsity", "TEAL-style magnitude sparsity: inputs below a per-site |x| threshold skip "
    "their rows of W.", (SPARSITY,), _sparsity_points, by_tree(sparse_bytes), KEPT_ROWS))
register(Method(
    "larosa", "LaRoSA-style rotated sparsity: magnitude sparsity on x Q, Q each site's PCA "
    "basis, read at every token.", (SPARSITY, LAROSA_SITES), _larosa_points, by_tree(sparse_bytes),
    KEPT_ROWS, runs_on=lambda grid, model: bool(grid["larosa_sites"])))
register(Method(
    "sparsity_greedy", "TEAL's greedy allocation: per layer, raise the site whose raise "
    "leaves the block output closest to dense.", (GREEDY_SPARSITY, GREEDY_STEP, GREEDY_WINDOWS),
    _greedy_points, by_tree(sparse_bytes), KEPT_ROWS, uniform="sparsity"))
