"""Calibrated bases: per layer and site, the top eigenvectors of X^T X."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from typing import Any

import jax
import numpy as np

from gsi_jax.runtime import distributed
from gsi_jax.errors import GSIError
from gsi_jax.models import params as P

FORMAT_VERSION = 3  # 2: checksums of every array; 3: and of the metadata itself


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


# id(tensor) -> (weak reference, digest): a tensor is hashed once while it lives.
_TENSOR_DIGESTS: dict[int, tuple[weakref.ref, bytes]] = {}


def expect_bases(bases) -> Bases:
  """`bases` when it is a Bases, else one GSIError naming the argument."""
  if not isinstance(bases, Bases):
    raise GSIError(f"bases must be the Bases that calibrate or load_bases returns, got "
                   f"{type(bases).__name__}")
  return bases


def _tensor_digest(leaf) -> bytes:
  """SHA-256 of one tensor's dtype, shape and bytes (one host copy at a time)."""
  hit = _TENSOR_DIGESTS.get(id(leaf))
  if hit is not None and hit[0]() is leaf:
    return hit[1]
  host = np.ascontiguousarray(distributed.host_copy(leaf))  # whole, also when sharded
  h = hashlib.sha256(f"{host.dtype.name}{host.shape}".encode())
  h.update(host.reshape(-1).view(np.uint8))
  digest = h.digest()
  try:
    ref = weakref.ref(leaf, lambda _, key=id(leaf): _TENSOR_DIGESTS.pop(key, None))
  except TypeError:  # a Python scalar: cheap to hash again
    return digest
  _TENSOR_DIGESTS[id(leaf)] = (ref, digest)
  return digest


def fingerprint(params) -> str:
  """Identity of a model's weights: every byte of every dense tensor, with its path.

  Streamed a tensor at a time, so a 6B model costs one read; GSI's additions are
  left out, so a rewritten tree keeps its model's identity.
  """
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(P.dense_params(params))[0]:
    h.update(jax.tree_util.keystr(path).encode())
    h.update(_tensor_digest(leaf))
  return h.hexdigest()[:24]


def windows_digest(ids_NT: np.ndarray) -> str:
  """Identity of calibration windows: their ids and their shape (a seq_len change shows)."""
  ids = np.ascontiguousarray(ids_NT, np.int32)
  return hashlib.sha256(f"{ids.shape}".encode() + ids.tobytes()).hexdigest()[:24]


def config_digest(config) -> str:
  """Identity of an architecture: every field of its ModelConfig but the display name."""
  fields = {k: v for k, v in dataclasses.asdict(config).items() if k != "name"}
  return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def calibration_identity(model, params, ids_NT: np.ndarray) -> dict[str, str]:
  """What a calibration's result depends on, besides its solver and k_max."""
  return {"fingerprint": fingerprint(params), "config_sha256": config_digest(model.config),
          "dtype": np.dtype(model.dtype).name, "text_sha256": windows_digest(ids_NT)}
