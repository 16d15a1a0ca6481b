"""apply_gsi: a pure rewrite of every linear-map site into (V_k, M, W)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gsi_jax.errors import GSIError, number, whole
from gsi_jax.gsi.bases import Bases, expect_bases, fingerprint
from gsi_jax.models import params as P


def site_rank(k: int, d: int) -> int:
  """k is capped at each site's width, so k = the widest site is exactly dense everywhere."""
  return min(k, d)


def check_k(params, k: int, name: str = "k") -> int:
  P.check_tree(params)
  k = whole(name, k, None)
  if k <= 0 or k > P.widest_site(params):
    raise GSIError(f"{name} must be in 1..{P.widest_site(params)} (the widest site), got {k}")
  return k


def check_bases(params, bases: Bases) -> None:
  expect_bases(bases)
  got = fingerprint(P.check_tree(params))
  if bases.meta.get("fingerprint") != got:
    raise GSIError(f"bases were calibrated for another model ({bases.meta.get('model')!r}, "
                   f"fingerprint {bases.meta.get('fingerprint')}, this model: {got}); "
                   "calibrate for this model")
  for layer, sites in P.site_widths(params).items():
    for site, d in sites.items():
      V = bases.vectors.get(layer, {}).get(site)
      if V is None or V.shape[0] != d:
        raise GSIError(f"bases lack a {d}-wide basis for {layer}/{site}; calibrate for this model")


def images(V_DK: jnp.ndarray, kernels: dict) -> dict:
  """M/{map} = V_kᵀ W per map, computed in float32, stored in W's dtype."""
  V32 = V_DK.astype(jnp.float32)
  return {n: (V32.T @ W.astype(jnp.float32)).astype(W.dtype) for n, W in kernels.items()}


def apply_gsi(params, bases: Bases, k: int, output_sketch: int = 0, seed: int = 0,
              ladder: tuple[int, ...] = ()):
  """New params where every site also holds V_k (d, k) and M/{map} = V_kᵀ W (k, O).

  The dense kernels stay (the slow path needs them); biases are untouched.
  Beyond the paper:
  output_sketch = s > 0 adds C = W Ω (d, s) and D = V_kᵀ C (k, s) over the
  site's maps, which switch it to the output-aware gate ‖W r‖ < ε ‖W x‖ (s
  columns of a random orthonormal Ω estimate both norms);
  ladder = lower ranks k_1 < k_2 < ... < k: each token takes the smallest rank
  whose residual passes the gate (the bases are nested prefixes).
  """
  k = check_k(params, k)
  output_sketch, seed = whole("output_sketch", output_sketch, 0), whole("seed", seed, None)
  ladder = tuple(whole("ladder rank", r, None) for r in ladder)
  if any(r <= 0 or r >= k for r in ladder) or list(ladder) != sorted(set(ladder)):
    raise GSIError(f"ladder ranks must increase strictly and lie in 1..{k - 1} (below k), "
                   f"got {list(ladder)}")
  check_bases(params, bases)
  out = params
  for layer, sites in P.site_kernels(params).items():
    for site, kernels in sites.items():
      dtype = next(iter(kernels.values())).dtype
      d = next(iter(kernels.values())).shape[0]
      k_site = site_rank(k, d)
      V = bases.vectors[layer][site]
      if V.shape[1] < k_site:
        raise GSIError(f"bases hold {V.shape[1]} directions for {layer}/{site}, k={k} needs "
                       f"{k_site}; calibrate with k_max >= {k_site}")
      V_DK = jnp.asarray(np.asarray(V[:, :k_site]), dtype)
      extra = {P.V: V_DK, P.M: images(V_DK, kernels)}
      if ladder:
        rungs = sorted({min(r, k_site) for r in ladder} | {k_site})
        extra[P.LADDER] = jnp.asarray(rungs, jnp.int32)
      if output_sketch:
        W_DO = jnp.concatenate([kernels[n] for n in sorted(kernels)], 1).astype(jnp.float32)
        s_cols = min(output_sketch, W_DO.shape[1])
        rng = np.random.default_rng([seed, P.layer_index(layer), len(site)])
        omega, _ = np.linalg.qr(rng.normal(size=(W_DO.shape[1], s_cols)))
        C_DS = W_DO @ jnp.asarray(omega, jnp.float32)
        extra[P.SKETCH] = C_DS.astype(dtype)
        extra[P.SKETCH_M] = (V_DK.astype(jnp.float32).T @ C_DS).astype(dtype)
      out = P.with_site(out, layer, site, extra)
  return out


def apply_residual_sparsity(gsi_params, thresholds: dict):
  """New params whose GSI sites compute y = g M + r_S W_S (`gsi_jax.ops.residual`):
  {layer: {site: t}} keeps the residual's entries with |r_i| ≥ t, and no gate runs.
  `gsi_jax.peers.sparsity_thresholds` on the GSI tree calibrates t for a target share."""
  for layer, sites in P.check_per_site(gsi_params, thresholds, "thresholds").items():
    for site, t in sites.items():
      if not P.has_gsi(gsi_params[layer][site]):
        raise GSIError(f"{layer}/{site} has no V_k: apply_gsi first")
      value = number(f"thresholds {layer}/{site}", t)
      if isinstance(value, float) and not value >= 0:
        raise GSIError(f"thresholds {layer}/{site} must be >= 0, got {t}")
  return P.with_site_values(gsi_params, P.RESIDUAL_THRESHOLD, thresholds)


def truncate_ranks(gsi_params, ranks: dict):
  """New params whose sites in {layer: {site: k}} keep V_k's first k columns and M's
  first k rows: the bases are nested, so that is the rank-k tree `apply_gsi` builds
  (k = 0 leaves a site no subspace: the sparse residual is then the input itself)."""
  out = gsi_params
  for layer, sites in P.check_per_site(gsi_params, ranks, "ranks").items():
    for site, k in sites.items():
      node = gsi_params[layer][site]
      if not P.has_gsi(node):
        raise GSIError(f"{layer}/{site} has no V_k: apply_gsi first")
      if P.LADDER in node or P.SKETCH in node:
        raise GSIError(f"{layer}/{site}: ranks cut V_k and M only, not a ladder or a sketch")
      if not 0 <= whole(f"{layer}/{site}: rank", k, 0) <= node[P.V].shape[1]:
        raise GSIError(f"{layer}/{site}: rank {k} is outside 0..{node[P.V].shape[1]}, the "
                       "width of its V_k")
      out = P.with_site(out, layer, site, {P.V: node[P.V][:, :k],
                                           P.M: {n: M[:k] for n, M in node[P.M].items()}})
  return out


def gsi_shapes(params, k: int, head_k: int = 0):
  """The tree `apply_gsi` (and with head_k > 0 `apply_gsi_head`) returns, as shapes only.

  params may be abstract (`gsi_jax.loading.param_shapes`): a GSI program can then
  be exported for a platform that is not here (`jax.export`) with no weights and
  no calibration.
  """
  shape = lambda *dims, dtype: jax.ShapeDtypeStruct(dims, dtype)
  out = params
  for layer, sites in P.site_kernels(params).items():
    for site, kernels in sites.items():
      W = next(iter(kernels.values()))
      k_site = site_rank(k, W.shape[0])
      out = P.with_site(out, layer, site, {
          P.V: shape(W.shape[0], k_site, dtype=W.dtype),
          P.M: {n: shape(k_site, W_n.shape[1], dtype=W_n.dtype) for n, W_n in kernels.items()}})
  if head_k:
    d, vocab = P.head_shape(params)
    dtype = P.head(params).get(P.KERNEL, params[P.EMBED][P.EMBEDDING]).dtype
    out = {**out, P.LM_HEAD: {**P.head(out), P.V: shape(d, head_k, dtype=dtype),
                              P.M: {P.HEAD_MAP: shape(head_k, P.head_m_columns(vocab),
                                                      dtype=dtype)}}}
  return out
