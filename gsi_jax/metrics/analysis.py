"""Analysis of the subspaces: depth coherence, residual ratios, Theorem 4's tightness."""

from __future__ import annotations

import logging

import numpy as np

from gsi_jax.runtime.distributed import host_copy
from gsi_jax.errors import whole
from gsi_jax.gsi.bases import Bases, expect_bases
from gsi_jax.models import params as P
from gsi_jax.ops import make_gate


def principal_cosines(A_DK: np.ndarray, B_DK: np.ndarray) -> np.ndarray:
  """Cosines of the principal angles between span(A) and span(B), descending."""
  return np.clip(np.linalg.svd(A_DK.T.astype(np.float64) @ B_DK.astype(np.float64),
                               compute_uv=False), 0.0, 1.0)


def random_subspace_cosine(d: int, k: int, seed: int = 0) -> float:
  """Mean principal cosine of two random k-dim subspaces of R^d: coherence's floor."""
  rng = np.random.default_rng(seed)
  A, _ = np.linalg.qr(rng.normal(size=(d, min(k, d))))
  B, _ = np.linalg.qr(rng.normal(size=(d, min(k, d))))
  return float(principal_cosines(A, B).mean())


def depth_coherence(bases: Bases, k: int) -> dict[str, list[float]]:
  """{site: [mean principal cosine between layer l and l+1, for each l]}."""
  expect_bases(bases)
  k = whole("k", k)
  out: dict[str, list[float]] = {}
  layers = P.layers(bases.vectors)
  for prev, cur in zip(layers, layers[1:]):
    for site, V in bases.vectors[cur].items():
      if site in bases.vectors[prev]:
        kk = min(k, V.shape[1])
        cos = principal_cosines(bases.vectors[prev][site][:, :kk], V[:, :kk])
        out.setdefault(site, []).append(float(cos.mean()))
  return out


def residual_ratios(model, params, bases, windows_NT: np.ndarray, ks: list[int],
                    batch_size: int = 4) -> dict:
  """ρ = ‖r‖ / ‖x‖ of every token at every site, for several k at once.

  Inputs come from the dense forward, so the fast-path share ρ < ε read off
  these arrays is the one a gate would see on the dense trajectory.
  Returns {layer: {site: (tokens, len(ks)) float32}}.
  """
  out: dict = {}
  for i in range(0, len(windows_NT), batch_size):
    for layer, sites in model.site_inputs(params, windows_NT[i:i + batch_size]).items():
      for site, x in sites.items():
        x = host_copy(x).astype(np.float64).reshape(-1, x.shape[-1])
        V = bases.vectors[layer][site].astype(np.float64)
        captured = np.cumsum((x @ V) ** 2, axis=1)  # ‖V_kᵀ x‖² for k = 1..k_max
        total = np.sum(x**2, axis=1)
        cols = [captured[:, min(k, V.shape[1]) - 1] for k in ks]
        rho = np.sqrt(np.clip(1 - np.stack(cols, 1) / total[:, None], 0, None))
        out.setdefault(layer, {}).setdefault(site, []).append(rho.astype(np.float32))
  return {layer: {site: np.concatenate(parts) for site, parts in sites.items()}
          for layer, sites in out.items()}


def theorem4_tightness(model, gsi_params, windows_NT: np.ndarray, eps: float,
                       batch_size: int = 2) -> dict:
  """Theorem 4's bound ‖W r‖ ≤ ‖W‖₂ ε ‖x‖ on every fast token of every map, and how tight.

  The bound follows from the gate (‖r‖ < ε ‖x‖) and ‖W r‖ ≤ ‖W‖₂ ‖r‖, so
  "violations" can only count float rounding: it checks the implementation, not
  the theorem.  What the data says is the tightness: error / bound, and
  error / (‖W‖₂ ‖r‖), the operator-norm step alone.
  """
  gate = make_gate(eps)
  kernels = P.site_kernels(gsi_params)
  kernels = {layer: {site: {n: host_copy(W).astype(np.float64) for n, W in ks.items()}
                     for site, ks in s.items()} for layer, s in kernels.items()}
  norms = {(layer, site, n): float(np.linalg.norm(W, 2))
           for layer, s in kernels.items() for site, ks in s.items() for n, W in ks.items()}
  over_bound, over_norm_r = [], []
  violations = 0
  for i in range(0, len(windows_NT), batch_size):
    _, state = model.forward(gsi_params, windows_NT[i:i + batch_size], gate,
                             collections=(P.SITE_INPUTS, "gate_stats"))
    inputs = P.unwrap_sown(state[P.SITE_INPUTS])
    for layer, s in kernels.items():
      for site, ks in s.items():
        x = host_copy(inputs[layer][site]).astype(np.float64)
        x = x[host_copy(state["gate_stats"][layer][site]["fast"][0])]
        if not len(x):
          continue
        V = host_copy(gsi_params[layer][site][P.V]).astype(np.float64)
        r = x - (x @ V) @ V.T
        x_norm, r_norm = np.linalg.norm(x, axis=-1), np.linalg.norm(r, axis=-1)
        for n, W in ks.items():
          err = np.linalg.norm(r @ W, axis=-1)
          bound = norms[(layer, site, n)] * eps * x_norm
          violations += int(np.sum(err > bound * (1 + 1e-4)))  # float32 gate rounding
          over_bound.append(err / bound)
          over_norm_r.append(err / (norms[(layer, site, n)] * r_norm + 1e-30))
  ratios = np.concatenate(over_bound) if over_bound else np.zeros(0)
  tight = np.concatenate(over_norm_r) if over_norm_r else np.zeros(0)
  logging.info("theorem 4: %d fast map-tokens, %d above the bound", len(ratios), violations)
  stat = lambda a, f: float(f(a)) if len(a) else None
  return {"eps": eps, "fast_map_tokens": int(len(ratios)), "violations": violations,
          "max_error_over_bound": stat(ratios, np.max),
          "median_error_over_bound": stat(ratios, np.median),
          "max_error_over_norm_r": stat(tight, np.max),
          "median_error_over_norm_r": stat(tight, np.median)}
