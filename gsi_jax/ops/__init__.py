"""The bottom of the import graph: the gate and the gated-linear operation.

Imports nothing from the rest of gsi_jax except `errors`.
"""

from gsi_jax.ops.cats import cats_gated_linear
from gsi_jax.ops.gate import (IMPLS, MODES, Gate, check_threshold, gate_mask, ladder_ranks,
                              make_gate, output_gate_mask, residual_energy, soft_fast, soft_keep,
                              straight_through)
from gsi_jax.ops.gated_linear import GatedWeights, dense_matmul, gated_linear
from gsi_jax.ops.kernel import gated_matmul, gated_matmul_on, gated_matmul_reference
from gsi_jax.ops.residual import residual_sparse_linear, subspace_residual
from gsi_jax.ops.sparse_rows import kept_dots, kept_product, kept_rows_matmul, magnitude_keep

__all__ = ["IMPLS", "MODES", "Gate", "GatedWeights", "cats_gated_linear", "check_threshold",
           "dense_matmul", "gate_mask", "gated_linear", "gated_matmul", "gated_matmul_on",
           "gated_matmul_reference", "kept_dots", "kept_product", "kept_rows_matmul",
           "ladder_ranks", "magnitude_keep", "make_gate", "output_gate_mask", "residual_energy",
           "residual_sparse_linear", "soft_fast", "soft_keep", "straight_through",
           "subspace_residual"]
