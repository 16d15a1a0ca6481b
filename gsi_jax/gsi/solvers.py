"""Top-k eigenpairs of a site's Gram matrix: exact eigh, and LOBPCG for wide sites.

`eigh` (float64, on the host) is the reference.  Wide sites use JAX's
maintained `lobpcg_standard` in float32 on the device: its cost per iteration
is O(d² k) against eigh's O(d³), and the depth cascade starts it from the
previous layer's basis.  lobpcg_standard needs 5k < d; narrower sites keep eigh
(cold start) or the block-Davidson refinement of cascade.py (warm start).
`lobpcg_on_device` is one program per shape that leaves its results on the device,
so that a calibration brings a whole layer's bases to the host in one copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.sparse.linalg import lobpcg_standard

from gsi_jax.runtime import distributed
from gsi_jax.gsi import cascade

LOBPCG_MAX_ITERATIONS = 100


def top_eigenpairs(G: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
  """Top-k eigenvalues (descending) and eigenvectors of a symmetric PSD matrix, exactly."""
  w, V = np.linalg.eigh(G)
  order = np.argsort(w)[::-1][:k]
  return w[order], V[:, order]


def lobpcg_fits(d: int, k: int) -> bool:
  """lobpcg_standard's own limit on the block size."""
  return 0 < 5 * k < d


@jax.jit
def _lobpcg(G_DD, X0_DK):
  # A matrix handed to lobpcg_standard directly is a static argument: it would be
  # compiled into the program as a constant (a second copy of G, and a compile per
  # matrix).  As a product closed over a traced G it is one program per shape.
  w, V, iterations = lobpcg_standard(lambda X: G_DD @ X, X0_DK, m=LOBPCG_MAX_ITERATIONS)
  order = jnp.argsort(-w)
  return w[order], V[:, order], iterations


def lobpcg_on_device(G_DD: jax.Array, X0_DK: jax.Array) -> tuple[jax.Array, jax.Array,
                                                                  jax.Array]:
  """(w descending, V, iterations) by LOBPCG from the start block X0, all on the device
  where G lives (float32): nothing reaches the host."""
  return _lobpcg(G_DD.astype(jnp.float32), X0_DK.astype(jnp.float32))


def lobpcg_top(G_DD: jax.Array, X0_DK: jax.Array) -> tuple[np.ndarray, np.ndarray, int]:
  """Top-k eigenpairs by LOBPCG from the start block X0, on the host in float64."""
  w, V, iterations = lobpcg_on_device(jnp.asarray(G_DD), jnp.asarray(X0_DK))
  return (distributed.host_copy(w).astype(np.float64),
          distributed.host_copy(V).astype(np.float64), int(iterations))


def lobpcg_flops(d: int, k: int, iterations: int) -> float:
  """Per iteration: G times the 3k-column search block, and orthonormalising it."""
  return iterations * (2.0 * d * d * 3 * k + 2.0 * d * (3 * k) ** 2 + cascade.eigh_flops(3 * k))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def random_start(d: int, k: int, seed: int = 0) -> jax.Array:
  """LOBPCG's cold start, made on the device (one program per shape, nothing sent to it)."""
  return jax.random.normal(jax.random.key(seed), (d, k), jnp.float32)


def energy_loss(G: np.ndarray, V: np.ndarray, exact_top: np.ndarray) -> float:
  """1 - (energy V captures) / (energy of the exact top-k eigenvectors)."""
  G = np.asarray(G, np.float64)
  V = np.asarray(V, np.float64)
  return float(1.0 - np.trace(V.T @ G @ V) / np.sum(exact_top))


def top_eigenpairs_float32(G_DD: jax.Array, k: int) -> tuple[np.ndarray, np.ndarray]:
  """Exact top-k eigenpairs in float32 on the device (LAPACK's syevd on a CPU)."""
  G = jnp.asarray(G_DD, jnp.float32)
  w, V = jnp.linalg.eigh((G + G.T) / 2)
  order = jnp.argsort(-w)[:k]
  return np.asarray(w[order], np.float64), np.asarray(V[:, order], np.float64)
