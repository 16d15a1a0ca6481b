"""The paper's method and its variants: gsi (the gate at each k and ε), static projection
(ε = ∞, the paper's negative control), gsi_out (an output-aware gate) and gsi_ladder
(nested ranks).  They read the shared --k and --eps."""

from __future__ import annotations

from gsi_jax.methods.common import GATED, by_tree, gated_bytes, positive
from gsi_jax.methods.registry import Knob, Method, Point, register
from gsi_jax.ops import make_gate

OUTPUT_SKETCH = Knob("output_sketch", int, 32, "Sketch columns of the output-aware gate (0: "
                     "skip it).", check=lambda v: None if v >= 0 else
                     "--output_sketch must be >= 0", many=False)
LADDER = Knob("ladder", int, ("64", "128", "256"), "Rank-ladder rungs (those below each k; "
              "empty: skip the ladder).", check=positive("ladder", "ranks must be positive"),
              may_be_empty=True, sort=True)


def decided_first(how: str) -> dict[str, str]:
  """GSI's fast paths for a gate decided before the product: the kernel then takes each
  token's decision as its threshold (∞: fast, 0: slow)."""
  return {platform: f"{how}, then {path}" for platform, path in GATED.items()}


def _gated_points(ctx, tree_at):
  """Every k × ε of the shared flags; tree_at(k) -> params (None: skip that k)."""
  for k in ctx.experiment.k:
    params = tree_at(k)
    if params is None:
      continue
    for eps in ctx.experiment.eps:
      yield Point(f"k={k},eps={eps}", params, make_gate(eps, impl=ctx.experiment.impl))


def _static_points(ctx):
  for k in ctx.experiment.k:
    yield Point(f"k={k}", ctx.gsi(k), make_gate(0.0, "static", impl=ctx.experiment.impl))


def _ladder_tree(ctx, k):
  rungs = ctx.grid["ladder"]
  return ctx.gsi(k, ladder=[r for r in rungs if r < k]) if rungs[0] < k else None


register(Method(
    "gsi", "Gated Subspace Inference: M g where ρ < ε, else W x (the paper).", (),
    lambda ctx: _gated_points(ctx, ctx.gsi), by_tree(gated_bytes), GATED))
register(Method(
    "gsi_out", "GSI gated on the sketched output error ‖x C − g D‖ < ε ‖x C‖.",
    (OUTPUT_SKETCH,),
    lambda ctx: _gated_points(ctx, lambda k: ctx.gsi(k, output_sketch=ctx.grid["output_sketch"])),
    by_tree(gated_bytes), decided_first("the output-aware gate decided per token in XLA"),
    runs_on=lambda grid, model: grid["output_sketch"] > 0))
register(Method(
    "gsi_ladder", "GSI with nested ranks: each token takes the smallest rung that passes.",
    (LADDER,), lambda ctx: _gated_points(ctx, lambda k: _ladder_tree(ctx, k)), by_tree(gated_bytes),
    decided_first("the rung chosen per token in XLA (V and M read whole)"),
    runs_on=lambda grid, model: bool(grid["ladder"])))
register(Method(
    "static", "Static projection: M g for every token (ε = ∞; ESPACE-style).", (),
    _static_points, by_tree(gated_bytes), GATED))
