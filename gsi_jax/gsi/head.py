"""The LM head as one more gated site (beyond the paper).

On a small model the head is a large share of the bytes a decode step reads
(SmolLM2-135M: 28 M of 135 M weights, tied to the embedding table).  Its
input, the final hidden state, gets its own calibrated basis; the head then
reads V_k and M = V_kᵀ W_head on fast tokens and W_head on slow ones, like
any site, at the gate's head_eps.  The embedding itself costs one row per
token and is left dense.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gsi_jax.errors import GSIError, whole
from gsi_jax.gsi.calibration import gram_matrices
from gsi_jax.gsi.solvers import top_eigenpairs
from gsi_jax.models import params as P


def head_basis(model, params, windows_NT: np.ndarray, k_max: int,
               progress: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
  """(V_DK, top energies, total energy) of the head's input over the calibration windows."""
  k_max = whole("head k", k_max, None)
  G = gram_matrices(model, params, windows_NT, progress=progress,
                    collection=P.HEAD_INPUTS)[P.LM_HEAD]
  G = (np.asarray(G, np.float64) + np.asarray(G, np.float64).T) / 2
  if not 0 < k_max <= G.shape[0]:
    raise GSIError(f"head k must be in 1..{G.shape[0]} (the head's input width), got {k_max}")
  w, V = top_eigenpairs(G, k_max)
  return V.astype(np.float32), w.astype(np.float32), float(np.trace(G))


def apply_gsi_head(params, V_DK: np.ndarray, k: int):
  """New params whose LM head also holds V_k and M = V_kᵀ W_head, M's columns padded with
  zeros to a multiple of P.HEAD_COLUMNS: a vocabulary such as GPT-2's 50257 would otherwise
  start every row of M unaligned, and a GPU kernel reads it with scalar loads."""
  W_DV = P.head_kernel(P.check_tree(params))
  k = whole("head k", k, None)
  if not (isinstance(V_DK, (np.ndarray, jax.Array)) and V_DK.ndim == 2):
    raise GSIError(f"the head basis must be a (d, k) array (head_basis returns one), got "
                   f"{type(V_DK).__name__}")
  if V_DK.shape[0] != W_DV.shape[0]:
    raise GSIError(f"head basis is {V_DK.shape[0]}-wide, the head reads {W_DV.shape[0]}; "
                   "calibrate the head of this model")
  if not 0 < k <= V_DK.shape[1]:
    raise GSIError(f"head k must be in 1..{V_DK.shape[1]} (the basis' columns), got {k}")
  V = jnp.asarray(V_DK[:, :k], W_DV.dtype)
  M = (V.astype(jnp.float32).T @ W_DV.astype(jnp.float32)).astype(W_DV.dtype)
  M = jnp.pad(M, ((0, 0), (0, P.head_m_columns(M.shape[1]) - M.shape[1])))
  return {**params, P.LM_HEAD: {**P.head(params), P.V: V, P.M: {P.HEAD_MAP: M}}}
