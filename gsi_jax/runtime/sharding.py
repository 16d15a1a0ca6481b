"""Tensor-parallel placement of (V_k, M, W) trees across a device mesh.

W and M split along d_out (their columns), biases with them; V_k, norms and
embeddings are replicated.  The gated forward and decode then run unchanged
under jit: XLA's partitioner inserts the collectives, and every device
computes g = V_k^T x and the gate for its own column slice.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gsi_jax.models import params as P

AXIS = "model"


def make_mesh(n_devices: int | None = None) -> Mesh:
  devices = jax.devices()[:n_devices] if n_devices else jax.devices()
  return Mesh(np.array(devices), (AXIS,))


def _spec(path_keys, leaf, sites, n) -> PartitionSpec:
  layer = path_keys[0]
  in_site = layer in sites and len(path_keys) > 1 and path_keys[1] in sites[layer]
  if not in_site or path_keys[2] in P.REPLICATED_KEYS:
    return PartitionSpec()
  transposed = path_keys[2] in P.TRANSPOSED_KEYS
  out_dim = leaf.shape[0 if transposed else -1]
  if out_dim % n:
    return PartitionSpec()  # a width the mesh does not divide stays whole
  if transposed:
    return PartitionSpec(AXIS, None)
  return PartitionSpec(None, AXIS) if leaf.ndim == 2 else PartitionSpec(AXIS)


def partition_specs(params, n_devices: int):
  """The PartitionSpec of every leaf (arrays or their ShapeDtypeStructs) on a mesh of
  `n_devices`: site kernels, M and biases split by columns, everything else whole."""
  sites = P.site_kernels(params)
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: _spec([p.key for p in path], leaf, sites, n_devices), params)


def shardings(params, mesh: Mesh):
  """The NamedSharding of every leaf, as `partition_specs` places it on `mesh`."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                      partition_specs(params, mesh.devices.size),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_params(params, mesh: Mesh):
  """Place every leaf on the mesh as `shardings` says."""
  return jax.tree.map(jax.device_put, params, shardings(params, mesh))
