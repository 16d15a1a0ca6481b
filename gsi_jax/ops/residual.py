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
import jax.numpy as jnp

from gsi_jax.ops.gate import Gate, soft_keep, straight_through
from gsi_jax.ops.sparse_rows import kept_rows_matmul


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
  keep_BTD = jnp.abs(r_BTD) >= threshold
  if gate is not None and gate.mode == "soft":
    keep_BTD = straight_through(keep_BTD, soft_keep(r_BTD, threshold))
    return [g_BTK @ M + (r_BTD * keep_BTD.astype(r_BTD.dtype)) @ W
            for M, W in zip(Ms, Ws)], keep_BTD
  if gate is not None and gate.batch1_switch and x_BTD.shape[:-1] == (1, 1):
    sparse = kept_rows_matmul(r_BTD.reshape(-1), keep_BTD.reshape(-1), Ws)
    return [(g_BTK @ M) + y.reshape(1, 1, -1) for M, y in zip(Ms, sparse)], keep_BTD
  r_BTD = jnp.where(keep_BTD, r_BTD, 0)
  return [g_BTK @ M + r_BTD @ W for M, W in zip(Ms, Ws)], keep_BTD
