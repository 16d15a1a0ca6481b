"""The LM head gated like a site (beyond the paper): head alone over dense sites, and
sparsity+head over magnitude sparsity."""

from __future__ import annotations

import gsi_jax
from gsi_jax.methods.common import KEPT_ROWS, by_tree, sparse_bytes, thresholds_ok
from gsi_jax.methods.registry import Knob, Method, Point, register
from gsi_jax.methods.sparsity import SPARSITY, sparse_tree
from gsi_jax.ops import make_gate

HEAD_K = Knob("head_k", int, 384, "Rank of the gated LM head (0: skip it).",
              check=lambda v: None if v >= 0 else "--head_k must be >= 0", many=False)
HEAD_EPS = Knob("head_eps", float, ("0.1", "0.2"), "Gate thresholds of the LM head.",
                check=thresholds_ok("head_eps"))


def _head_basis(ctx):
  k = ctx.grid["head_k"]
  return ctx.shared(("head_basis", k), lambda: gsi_jax.head_basis(
      ctx.model, ctx.base, ctx.calib_ids, k)[0])


def _gate(ctx, head_eps):
  return make_gate(0.0, head_eps=head_eps, impl=ctx.experiment.impl)  # sites stay dense


def _head_points(ctx):
  k = ctx.grid["head_k"]
  tree = gsi_jax.apply_gsi_head(ctx.base, _head_basis(ctx), k)
  for head_eps in ctx.grid["head_eps"]:
    yield Point(f"head_k={k},head_eps={head_eps}", tree, _gate(ctx, head_eps))


def _sparsity_head_points(ctx):
  for head_eps in ctx.grid["head_eps"]:
    for sp in ctx.grid["sparsity"]:
      yield Point(f"target={sp},head_eps={head_eps}", gsi_jax.apply_gsi_head(
          sparse_tree(ctx, sp), _head_basis(ctx), ctx.grid["head_k"]), _gate(ctx, head_eps))


HEAD_PATH = {platform: f"sites: {path}; head: the batch-1 switch or gated_matmul"
             for platform, path in KEPT_ROWS.items()}
register(Method(
    "head", "The LM head gated like a site at head_eps, every other site dense.",
    (HEAD_K, HEAD_EPS), _head_points, by_tree(sparse_bytes), HEAD_PATH,
    runs_on=lambda grid, model: grid["head_k"] > 0))
register(Method(
    "sparsity+head", "Magnitude sparsity with the gated LM head on top.",
    (SPARSITY, HEAD_K, HEAD_EPS), _sparsity_head_points, by_tree(sparse_bytes), HEAD_PATH,
    runs_on=lambda grid, model: grid["head_k"] > 0))
