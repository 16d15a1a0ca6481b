"""apply_gsi: a pure rewrite of every linear-map site into (V_k, M, W)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from gsi_jax.errors import GSIError
from gsi_jax.gsi.bases import Bases, fingerprint, site_kernels


GSI_KEYS = ("basis", "image", "sketch", "sketch_image", "ladder")


def site_rank(k: int, d: int) -> int:
  """k is capped at each site's width, so k = max width is exactly dense everywhere."""
  return min(k, d)


def check_bases(params, bases: Bases) -> None:
  sites = site_kernels(params)
  got = fingerprint(params)
  if bases.meta.get("fingerprint") != got:
    raise GSIError(f"bases were calibrated for another model ({bases.meta.get('model')!r}, "
                   f"fingerprint {bases.meta.get('fingerprint')}, this model: {got}); "
                   "calibrate for this model")
  for layer, layer_sites in sites.items():
    for site, kernels in layer_sites.items():
      V = bases.vectors.get(layer, {}).get(site)
      d = next(iter(kernels.values())).shape[0]
      if V is None or V.shape[0] != d:
        raise GSIError(f"bases lack a {d}-wide basis for {layer}/{site}; calibrate for this model")


def apply_gsi(params, bases: Bases, k: int, output_sketch: int = 0, seed: int = 0,
              ladder: tuple[int, ...] = ()):
  """New params where every site also holds basis V_DK and image M_KO = V^T [W_1|W_2|...].

  The dense kernels stay (the slow path needs them); biases are untouched.
  Beyond the paper:
  output_sketch = s > 0 adds C = W Omega (d, s) and D = V^T C (k, s), which
  switch the site to the output-aware gate ||W r|| < eps ||W x|| (s columns
  of a random orthonormal Omega estimate both norms);
  ladder = lower ranks k_1 < k_2 < ... < k: each token takes the smallest
  rank whose residual passes the gate (the bases are nested prefixes).
  """
  k = int(k)
  ladder = tuple(int(r) for r in ladder)
  if any(r <= 0 or r >= k for r in ladder) or list(ladder) != sorted(set(ladder)):
    raise GSIError(f"ladder ranks must increase strictly and lie in 1..{k - 1} (below k), "
                   f"got {list(ladder)}")
  widths = [W.shape[0] for s in site_kernels(params).values() for ks in s.values()
            for W in ks.values()]
  if k <= 0 or k > max(widths):
    raise GSIError(f"k must be in 1..{max(widths)} (the widest site), got {k}")
  check_bases(params, bases)
  out = dict(params)
  for layer, layer_sites in site_kernels(params).items():
    block = dict(out[layer])
    for site, kernels in layer_sites.items():
      W_DO = jnp.concatenate([kernels[n] for n in sorted(kernels)], axis=1)  # LinearSite's order
      d = W_DO.shape[0]
      k_site = site_rank(k, d)
      V = bases.vectors[layer][site]
      if V.shape[1] < k_site:
        raise GSIError(f"bases hold {V.shape[1]} directions for {layer}/{site}, k={k} needs "
                       f"{k_site}; calibrate with k_max >= {k_site}")
      V_DK = jnp.asarray(np.asarray(V[:, :k_site]), W_DO.dtype)
      M_KO = (V_DK.astype(jnp.float32).T @ W_DO.astype(jnp.float32)).astype(W_DO.dtype)
      extra = {"basis": V_DK, "image": M_KO}
      if ladder:
        rungs = sorted({min(r, k_site) for r in ladder} | {k_site})
        extra["ladder"] = jnp.asarray(rungs, jnp.int32)
      if output_sketch:
        s_cols = min(output_sketch, W_DO.shape[1])
        key = np.random.default_rng([seed, int(layer.split("_")[1]), len(site)])
        omega, _ = np.linalg.qr(key.normal(size=(W_DO.shape[1], s_cols)))
        C_DS = W_DO.astype(jnp.float32) @ jnp.asarray(omega, jnp.float32)
        extra["sketch"] = C_DS.astype(W_DO.dtype)
        extra["sketch_image"] = (V_DK.astype(jnp.float32).T @ C_DS).astype(W_DO.dtype)
      block[site] = {**block[site], **extra}
    out[layer] = block
  return out


def dense_params(params):
  """The dense tree back: drop every basis and image, the LM head's included."""
  out = dict(params)
  for layer, layer_sites in site_kernels(params).items():
    out[layer] = {**out[layer], **{
        site: {k: v for k, v in out[layer][site].items() if k not in GSI_KEYS}
        for site in layer_sites}}
  head = {k: v for k, v in out.pop("lm_head", {}).items() if k not in GSI_KEYS}
  if head:  # a tied head has no parameters of its own
    out["lm_head"] = head
  return out
