"""Calibrated bases: per layer and site, the top eigenvectors of X^T X."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np

from gsi_jax.models import params as P

FORMAT_VERSION = 2  # 2: checksums of every array in the metadata


@dataclasses.dataclass
class Bases:
  """vectors[layer][site]: (d, k_max) orthonormal columns, by decreasing energy.

  eigenvalues[layer][site]: (k_max,) energies of those directions;
  trace[layer][site]: total energy (sum of all eigenvalues), so
  eigenvalues.cumsum() / trace is the captured-energy curve.
  meta: JSON-able provenance (model, text source, tokens, method, ...).
  """
  vectors: dict[str, dict[str, np.ndarray]]
  eigenvalues: dict[str, dict[str, np.ndarray]]
  trace: dict[str, dict[str, np.ndarray]]
  meta: dict[str, Any]

  @property
  def k_max(self) -> int:
    return int(self.meta["k_max"])

  def sites(self):
    """(layer, site) pairs in model order."""
    return [(layer, site) for layer in P.layers(self.vectors) for site in self.vectors[layer]]

  def arrays(self) -> dict:
    return {"vectors": self.vectors, "eigenvalues": self.eigenvalues, "trace": self.trace}

  def captured_energy(self, k: int) -> dict[str, dict[str, float]]:
    return {layer: {site: float(self.eigenvalues[layer][site][:k].sum()
                                / self.trace[layer][site])
                    for site in sites}
            for layer, sites in self.vectors.items()}


def fingerprint(params) -> str:
  """Identity of a model's weights: shapes of every site plus a sample of values."""
  h = hashlib.sha256()
  for layer, sites in sorted(P.site_kernels(params).items()):
    for site, kernels in sorted(sites.items()):
      for name, W in sorted(kernels.items()):
        h.update(f"{layer}/{site}/{name}{tuple(W.shape)}".encode())
        h.update(np.asarray(jax.device_get(W.reshape(-1)[:64]), np.float32).tobytes())
  return h.hexdigest()[:16]
