"""Depth coherence: how aligned consecutive layers' subspaces are."""

from __future__ import annotations

import numpy as np

from gsi_jax.gsi.bases import Bases


def principal_cosines(A_DK: np.ndarray, B_DK: np.ndarray) -> np.ndarray:
  """Cosines of the principal angles between span(A) and span(B), descending."""
  return np.clip(np.linalg.svd(A_DK.T.astype(np.float64) @ B_DK.astype(np.float64),
                               compute_uv=False), 0.0, 1.0)


def depth_coherence(bases: Bases, k: int) -> dict[str, list[float]]:
  """{site: [mean principal cosine between layer l and l+1, for each l]}."""
  out: dict[str, list[float]] = {}
  layers = sorted(bases.vectors, key=lambda name: int(name.split("_")[1]))
  for prev, cur in zip(layers, layers[1:]):
    for site, V in bases.vectors[cur].items():
      if site in bases.vectors[prev]:
        kk = min(k, V.shape[1])
        cos = principal_cosines(bases.vectors[prev][site][:, :kk], V[:, :kk])
        out.setdefault(site, []).append(float(cos.mean()))
  return out
