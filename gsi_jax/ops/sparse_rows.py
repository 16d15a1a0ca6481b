"""Magnitude sparsity's batch-1 fast path: read only the rows of W for the kept inputs.

    y = Σ_{i kept} x_i W_i   (W stored (d, O), so row i is what input i multiplies)

Two implementations with one signature:
  `kept_rows_matmul_xla`: XLA needs static shapes, so the kept indices are gathered
    into one of a few bucket sizes: a lax.switch picks the smallest bucket that
    holds every kept input, and the unused slots are padded with zero inputs.  Rows
    are read in proportion to the bucket (at most 1/n_buckets of d more than the
    kept count), but XLA's CPU backend copies the gathered rows before its dot, so
    they are moved about three times (benchmarks/sparse_rows.py).  The last
    bucket, all d rows, is the masked product itself.
  the CPU kernel (`gsi_jax.ops.cpu_kernels`, float32): streams each kept row once.
`kept_rows_matmul` takes the kernel where the program is lowered for cpu in float32
and the kernel could be built, and the XLA path everywhere else.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from gsi_jax.ops import cpu_kernels

N_BUCKETS = 8


def bucket_sizes(d: int, n_buckets: int = N_BUCKETS) -> tuple[int, ...]:
  """Ascending gather sizes, the last one d: ceil(d j / n) for j = 1..n."""
  return tuple(sorted({-(-d * j // n_buckets) for j in range(1, n_buckets + 1)}))


def kept_rows_matmul_xla(x_D: jax.Array, keep_D: jax.Array, Ws: Sequence[jax.Array],
                         n_buckets: int = N_BUCKETS) -> list[jax.Array]:
  """x·keep @ W for each W (d, O), reading only ~the kept rows; one token (x_D: (d,))."""
  d = x_D.shape[0]
  sizes = bucket_sizes(d, n_buckets)
  count = jnp.sum(keep_D, dtype=jnp.int32)

  def gathered(size):
    def run():
      if size == d:  # every row: the masked product reads W in place, with no gathered copy
        return [jnp.where(keep_D, x_D, 0) @ W for W in Ws]
      idx = jnp.nonzero(keep_D, size=size, fill_value=0)[0]
      x_S = jnp.where(jnp.arange(size) < count, x_D[idx], 0)
      return [x_S @ W[idx] for W in Ws]
    return run

  branch = jnp.searchsorted(jnp.asarray(sizes), count)  # the first size >= count
  return lax.switch(branch, [gathered(s) for s in sizes])


def kept_rows_matmul(x_D: jax.Array, keep_D: jax.Array, Ws: Sequence[jax.Array],
                     n_buckets: int = N_BUCKETS) -> list[jax.Array]:
  """The same product, through the CPU kernel where it applies (see the module)."""
  xla = lambda: kept_rows_matmul_xla(x_D, keep_D, Ws, n_buckets)
  float32 = x_D.dtype == jnp.float32 and all(W.dtype == jnp.float32 for W in Ws)
  if not float32 or not cpu_kernels.available():
    return xla()
  return lax.platform_dependent(
      cpu=lambda: [cpu_kernels.kept_rows(x_D, keep_D.astype(bool), W) for W in Ws],
      default=xla)
