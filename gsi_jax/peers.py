"""GSI's peers, as pure rewrites of the same parameter tree.

  * static activation projection (ESPACE-style): GSI with mode "static";
  * static weight SVD, activation-aware (SVD-LLM's whitening): per map, the
    rank-r W_r minimising ||X W - X W_r|| over the calibration inputs X
    (whitened_svds once, then svd_truncate per rank);
  * magnitude activation sparsity (TEAL-style): per site, a threshold on |x|
    calibrated for a target sparsity; inputs below it are zeroed and their
    rows of W need not be read.
Each comes with the weight bytes it reads per decoded token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gsi_jax.errors import GSIError
from gsi_jax.gsi.bases import site_kernels


def whitened_svds(params, grams: dict, floor: float = 1e-6) -> dict:
  """Per map, the SVD of S W with S = Lambda^1/2 Q^T from G = X^T X = Q Lambda Q^T.

  ||X (W - W_r)|| = ||S (W - W_r)||, so truncating S W is optimal for the
  calibration inputs (SVD-LLM's whitening).  Eigenvalues are floored at
  `floor` x the largest, so rank-deficient Gram matrices stay invertible.
  Computed once; svd_truncate then rebuilds any rank cheaply.
  """
  out = {}
  for layer, sites in site_kernels(params).items():
    for site, kernels in sites.items():
      G = np.asarray(grams[layer][site], np.float64)
      lam, Q = np.linalg.eigh((G + G.T) / 2)
      root = np.sqrt(np.maximum(lam, floor * lam.max()))
      for name, W in kernels.items():
        U, S, Vt = np.linalg.svd(root[:, None] * (Q.T @ np.asarray(W, np.float64)),
                                 full_matrices=False)
        out[(layer, site, name)] = (Q / root, U * S, Vt, W.dtype)  # W_r = (Q/root) U_r S_r Vt_r
  return out


def svd_truncate(params, svds: dict, rank: int):
  """Dense params with each kernel replaced by its whitened rank-r reconstruction
  (the factored form's outputs), for quality; bytes come from svd_linear_elements."""
  if rank <= 0:
    raise GSIError(f"SVD rank must be positive, got {rank}")
  out = jax.tree.map(lambda x: x, params)
  for (layer, site, name), (unwhiten, US, Vt, dtype) in svds.items():
    r = min(rank, Vt.shape[0])
    out[layer][site]["kernel"][name] = jnp.asarray(unwhiten @ (US[:, :r] @ Vt[:r]), dtype)
  return out


def svd_linear_elements(params, rank: int) -> float:
  """Weights read per token by the factored maps: r (d + O) each, capped at d O."""
  total = 0.0
  for sites in site_kernels(params).values():
    for kernels in sites.values():
      for W in kernels.values():
        d, o = W.shape
        total += min(min(rank, d, o) * (d + o), d * o)
  return total


def sparsity_thresholds(model, params, windows_NT: np.ndarray, sparsity: float,
                        max_windows: int = 8) -> dict:
  """{layer: {site: t}}: the |x| quantile that zeroes `sparsity` of each site's inputs."""
  if not 0 <= sparsity < 1:
    raise GSIError(f"sparsity must be in [0, 1), got {sparsity}")
  _, state = model.forward(params, windows_NT[:max_windows], None, collections=("site_inputs",))
  return {layer: {site: float(np.quantile(np.abs(np.asarray(v["x"][0], np.float32)), sparsity))
                  for site, v in sites.items()}
          for layer, sites in state["site_inputs"].items()}


def apply_sparsity(params, thresholds: dict):
  out = dict(params)
  for layer, sites in thresholds.items():
    out[layer] = {**out[layer], **{
        site: {**out[layer][site], "threshold": jnp.asarray(t, jnp.float32)}
        for site, t in sites.items()}}
  return out
