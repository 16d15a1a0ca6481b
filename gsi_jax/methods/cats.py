"""CATS (gated MLPs only): per layer, channels with small |act(x W_gate)| skip their
columns of W_up and rows of W_down; attention stays dense."""

from __future__ import annotations

from gsi_jax import peers
from gsi_jax.methods.common import (CPU_KEPT_ROWS, GPU_KEPT_ROWS, TPU_KEPT_ROWS, by_tree, in_unit,
                                    sparse_bytes)
from gsi_jax.methods.registry import Knob, Method, Point, register

CATS_SPARSITY = Knob("cats_sparsity", float, ("0.4", "0.5", "0.6", "0.7", "0.8"),
                     "CATS target shares of dropped MLP channels, in [0, 1).",
                     check=in_unit("cats_sparsity"))


def _points(ctx):
  for sp in ctx.grid["cats_sparsity"]:
    thresholds = peers.cats_thresholds(ctx.model, ctx.base, ctx.calib_ids, sp)
    yield Point(f"target={sp}", peers.apply_cats(ctx.model, ctx.base, thresholds))


CPU_DOTS = "kept_dots: the C++ kernel's kept dots of W_up stored transposed"
GPU_DOTS = "kept_kernel.kept_dots, the Pallas kernel in Triton (impl pallas or auto)"
register(Method(
    "cats", "CATS: MLP channels below a per-layer |act(x W_gate)| threshold are dropped.",
    (CATS_SPARSITY,), _points, by_tree(sparse_bytes),
    {"cpu": f"up: {CPU_DOTS}; down: {CPU_KEPT_ROWS}",
     **dict.fromkeys(("cuda", "rocm"), f"up: {GPU_DOTS}; down: {GPU_KEPT_ROWS}"),
     "tpu": TPU_KEPT_ROWS},
    runs_on=lambda grid, model: model.gated_mlp,
    needs=("a gated MLP (gate and up projections)", lambda model: model.gated_mlp)))
