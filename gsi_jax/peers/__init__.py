"""GSI's peers, as pure rewrites of the same parameter tree.

  * static activation projection (ESPACE-style): GSI with mode "static";
  * static weight SVD, activation-aware (SVD-LLM's whitening): per map, the
    rank-r W_r minimising ||X W - X W_r|| over the calibration inputs X
    (whitened_svds once, then svd_truncate per rank), run as two thin maps;
  * magnitude activation sparsity (TEAL-style): per site, a threshold on |x|
    calibrated for a target sparsity; inputs below it are zeroed and their
    rows of W are not read (at batch 1: `gsi_jax.ops.kept_rows_matmul`);
  * LaRoSA-style rotated sparsity: the same, on the input rotated into its
    site's full PCA basis Q (GSI's eigenbasis, all d columns), with kernels
    Qᵀ W; Q itself is read at every token;
  * R-Sparse-style rank-aware sparsity: the kept inputs exact through W's
    rows, the dropped ones through a rank-r factor of W (`weight_factors`; its
    per-layer recipe: `gsi_jax.peers.rsparse_search`);
  * CATS-style sparsity for gated MLPs: per layer, a threshold on
    |act(x W_gate)| calibrated for a target share of dropped channels; only the
    kept columns of W_up and rows of W_down are read (`apply_cats`).
Their bytes per decoded token come from `gsi_jax.metrics.bytes`.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gsi_jax.errors import GSIError, whole
from gsi_jax.gsi import solvers
from gsi_jax.metrics import bytes as mbytes
from gsi_jax.models import params as P
from gsi_jax.models.activations import activation


def whitened_svds(params, grams: dict, floor: float = 1e-6) -> dict:
  """Per map, the SVD of S W with S = Lambda^1/2 Q^T from G = X^T X = Q Lambda Q^T.

  ||X (W - W_r)|| = ||S (W - W_r)||, so truncating S W is optimal for the
  calibration inputs (SVD-LLM's whitening).  Eigenvalues are floored at
  `floor` x the largest, so rank-deficient Gram matrices stay invertible.
  Computed once; svd_truncate then rebuilds any rank cheaply.
  """
  out = {}
  for layer, sites in P.site_kernels(params).items():
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
  """Params with each map at its whitened rank-r: two thin maps x A B, A (d, r) and
  B (r, O), where r (d + O) < d O, else the kernel W_r = A B itself (so the model
  reads what `metrics.bytes.svd_bytes` counts)."""
  if whole("SVD rank", rank, None) <= 0:
    raise GSIError(f"SVD rank must be positive, got {rank}")
  out = jax.tree.map(lambda x: x, params)
  for (layer, site, name), (unwhiten, US, Vt, dtype) in svds.items():
    r = min(rank, Vt.shape[0])
    A, B = unwhiten @ US[:, :r], Vt[:r]
    d, o = A.shape[0], B.shape[1]
    node = out[layer][site]
    if mbytes.svd_map_elements(d, o, r) < d * o:  # the two thin maps read fewer bytes
      node.setdefault(P.FACTOR_IN, {})[name] = jnp.asarray(A, dtype)
      node.setdefault(P.FACTOR_OUT, {})[name] = jnp.asarray(B, dtype)
    else:
      node[P.KERNEL][name] = jnp.asarray(A @ B, dtype)
  return out


def sparsity_thresholds(model, params, windows_NT: np.ndarray, sparsity: float,
                        max_windows: int = 8) -> dict:
  """{layer: {site: t}}: the |x| quantile that zeroes `sparsity` of each site's inputs
  (of x Q at a rotated site, of the residual x − x V_k V_kᵀ at a site with V_k)."""
  if not 0 <= sparsity < 1:
    raise GSIError(f"sparsity must be in [0, 1), got {sparsity}")

  def site_input(layer, site, x):  # what the site thresholds
    x, node = np.asarray(x, np.float32), params[layer][site]
    if P.ROTATION in node:  # LaRoSA: x Q
      return x @ np.asarray(node[P.ROTATION], np.float32)
    if P.V in node:  # the subspace plus sparse residual: r = x - x V_k V_kᵀ
      V = np.asarray(node[P.V], np.float32)
      return x - (x @ V) @ V.T
    return x
  return {layer: {site: float(np.quantile(np.abs(site_input(layer, site, x)), sparsity))
                  for site, x in sites.items()}
          for layer, sites in model.site_inputs(params, windows_NT[:max_windows]).items()}


def apply_sparsity(params, thresholds: dict):
  """New params whose sites zero inputs below their threshold."""
  return P.with_site_values(params, P.THRESHOLD, thresholds)


def check_gated_mlp(model):
  if not model.config.gated_mlp:
    raise GSIError(f"CATS needs a gated MLP (gate and up projections); this "
                   f"{model.config.family} model's MLP has none")


def cats_thresholds(model, params, windows_NT: np.ndarray, sparsity: float,
                    max_windows: int = 8) -> dict:
  """{layer: t}: the |act(x W_gate)| quantile that drops `sparsity` of each layer's
  MLP channels, on the calibration windows."""
  check_gated_mlp(model)
  if not 0 <= sparsity < 1:
    raise GSIError(f"sparsity must be in [0, 1), got {sparsity}")
  out = {}
  for layer, sites in model.site_inputs(params, windows_NT[:max_windows]).items():
    W_gate = params[layer]["mlp_in"][P.KERNEL]["gate"]
    a = activation(model.config.activation, jnp.asarray(sites["mlp_in"], jnp.float32)
                   @ jnp.asarray(W_gate, jnp.float32))
    out[layer] = float(np.quantile(np.abs(np.asarray(a)), sparsity))
  return out


def apply_cats(model, params, thresholds: dict):
  """New params whose gated MLPs drop the channels with |act(x W_gate)| below their
  layer's threshold (`gsi_jax.ops.cats`).  mlp_in gains the threshold and W_up
  transposed (the fast path reads its kept rows; stored beside W_up, so the tree
  holds one more copy of it); mlp_out skips the rows whose input is exactly 0."""
  check_gated_mlp(model)
  out = params
  for layer, t in thresholds.items():
    if P.BIAS in params[layer]["mlp_in"]:  # up's bias would make the dropped channels nonzero
      raise GSIError(f"CATS is not built for MLPs with biases ({layer}/mlp_in has one)")
    up = params[layer]["mlp_in"][P.KERNEL]["up"]
    out = P.with_site(out, layer, "mlp_in", {P.CATS_THRESHOLD: jnp.asarray(t, jnp.float32),
                                             P.CATS_UP_T: up.T})
    out = P.with_site(out, layer, "mlp_out", {P.THRESHOLD: jnp.asarray(
        np.finfo(np.float32).tiny, jnp.float32)})
  return out


def weight_svds(params) -> dict:
  """{(layer, site, map): (U S, Vᵀ, dtype)}: the SVD of each W itself (float64), computed
  once; `weight_factors` cuts any rank from it."""
  out = {}
  for layer, sites in P.site_kernels(params).items():
    for site, kernels in sites.items():
      for name, W in kernels.items():
        U, S, Vt = np.linalg.svd(np.asarray(W, np.float64), full_matrices=False)
        out[layer, site, name] = (U * S, Vt, W.dtype)
  return out


def weight_factors(params, rank, svds: dict | None = None, width: dict | None = None):
  """R-Sparse's low-rank part: per map the top-r SVD of W itself (not whitened, as its
  paper describes), x A B with A = U_r S_r (d, r) and B = V_rᵀ (r, O).  With a
  threshold (`apply_sparsity`) the kept inputs read W's rows exactly and the dropped
  ones go through A B.

  rank: one r for every map, or {layer: {site: {map: r}}} (a per-layer recipe, where
  r may be 0).  width, nested alike: zero columns pad each factor to it, which leaves
  x A B unchanged, so recipes of different ranks share one compiled program."""
  if not isinstance(rank, dict) and whole("R-Sparse rank", rank, None) <= 0:
    raise GSIError(f"R-Sparse rank must be positive, got {rank}")
  svds = weight_svds(params) if svds is None else svds
  out = params
  for layer, sites in P.site_kernels(params).items():
    for site, kernels in sites.items():
      A, B = {}, {}
      for name in kernels:
        US, Vt, dtype = svds[layer, site, name]
        r = min(int(rank) if not isinstance(rank, dict) else
                whole(f"R-Sparse rank of {layer}/{site}/{name}", rank[layer][site][name], 0),
                len(Vt))
        w = r if width is None else width[layer][site][name]
        if w < r:
          raise GSIError(f"{layer}/{site}/{name}: factor width {w} is below its rank {r}")
        A_DR, B_RO = np.zeros((US.shape[0], w)), np.zeros((w, Vt.shape[1]))
        A_DR[:, :r], B_RO[:r] = US[:, :r], Vt[:r]
        A[name], B[name] = jnp.asarray(A_DR, dtype), jnp.asarray(B_RO, dtype)
      out = P.with_site(out, layer, site, {P.FACTOR_IN: A, P.FACTOR_OUT: B})
  return out


def pca_bases(grams: dict, sites: Sequence[str]) -> dict:
  """{layer: {site: Q (d, d)}}: each named site's full eigenbasis of its Gram
  matrix, columns by descending eigenvalue (GSI's V_k is its first k columns)."""
  out = {}
  for layer, by_site in grams.items():
    for site in sites:
      if site in by_site:
        G = np.asarray(by_site[site], np.float64)
        out.setdefault(layer, {})[site] = solvers.top_eigenpairs((G + G.T) / 2, len(G))[1]
  return out


def apply_rotation(params, bases: dict):
  """New params whose named sites read their input in the PCA basis: x Q, with
  kernels Qᵀ W (the same outputs); sparsity thresholds then apply to x Q."""
  out = params
  for layer, sites in bases.items():
    for site, Q in sites.items():
      node = params[layer][site]
      dtype = next(iter(node[P.KERNEL].values())).dtype
      kernels = {n: jnp.asarray(Q.T @ np.asarray(W, np.float64), dtype)
                 for n, W in node[P.KERNEL].items()}
      out = P.with_site(out, layer, site, {P.ROTATION: jnp.asarray(Q, dtype),
                                            P.KERNEL: kernels})
  return out
