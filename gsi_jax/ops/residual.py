"""Subspace plus sparse residual (beyond the paper): y = g M + r_S W_S.

    g = x V_k,   r = x − g V_kᵀ,   S = {i : |r_i| ≥ t},   y_i = g M_i + r_S W_i[S]

g M + r W = x V_k V_kᵀ W + (x − x V_k V_kᵀ) W = x W, so keeping every residual
entry is dense (up to rounding), an empty S is static GSI (t = ∞), and k = 0
would be magnitude sparsity.  Where GSI pays all of W for a token whose ρ
misses ε, this pays only W's rows where the residual is large.  Per token it
reads V_k (for g, and again for r: the second read follows the first at once),
M, and W's rows in S; at batch 1 under gate.batch1_switch only those rows are
read (`kept_rows_matmul`).
"""

from __future__ import annotations

from typing import Sequence

import jax

from gsi_jax.ops.gate import Gate
from gsi_jax.ops.sparse_rows import kept_product


def subspace_residual(x_BTD: jax.Array, V_DK: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(g, r): the input's coordinates in V_k and what V_k leaves of it."""
  g_BTK = x_BTD @ V_DK
  return g_BTK, x_BTD - g_BTK @ V_DK.T


def residual_sparse_linear(x_BTD: jax.Array, V_DK: jax.Array, Ms: Sequence[jax.Array],
                           Ws: Sequence[jax.Array], threshold: jax.Array,
                           gate: Gate | None) -> tuple[list[jax.Array], jax.Array]:
  """Outputs per map and the kept mask (B, T, d) of the residual (a float in mode
  "soft": the hard mask forward, `soft_keep`'s gradient backward)."""
  g_BTK, r_BTD = subspace_residual(x_BTD, V_DK)
  sparse, keep_BTD = kept_product(r_BTD, threshold, Ws, gate)
  return [g_BTK @ M + y for M, y in zip(Ms, sparse)], keep_BTD
