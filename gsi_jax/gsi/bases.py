"""Calibrated bases: per layer and site, the top eigenvectors of X^T X."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np

FORMAT_VERSION = 1


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
    layers = sorted(self.vectors, key=lambda name: int(name.split("_")[1]))
    return [(layer, site) for layer in layers for site in self.vectors[layer]]

  def arrays(self) -> dict:
    return {"vectors": self.vectors, "eigenvalues": self.eigenvalues, "trace": self.trace}

  def captured_energy(self, k: int) -> dict[str, dict[str, float]]:
    return {layer: {site: float(self.eigenvalues[layer][site][:k].sum()
                                / self.trace[layer][site])
                    for site in sites}
            for layer, sites in self.vectors.items()}


def site_kernels(params) -> dict[str, dict[str, dict[str, Any]]]:
  """{layer: {site: {map: W_DO}}} for every linear-map site in a param tree."""
  out = {}
  for layer, block in params.items():
    if not layer.startswith("layer_"):
      continue
    for site, node in block.items():
      if isinstance(node, dict) and isinstance(node.get("kernel"), dict):
        out.setdefault(layer, {})[site] = node["kernel"]
  return out


def fingerprint(params) -> str:
  """Identity of a model's weights: shapes of every site plus a sample of values."""
  h = hashlib.sha256()
  for layer, sites in sorted(site_kernels(params).items()):
    for site, kernels in sorted(sites.items()):
      for name, W in sorted(kernels.items()):
        h.update(f"{layer}/{site}/{name}{tuple(W.shape)}".encode())
        h.update(np.asarray(jax.device_get(W.reshape(-1)[:64]), np.float32).tobytes())
  return h.hexdigest()[:16]
