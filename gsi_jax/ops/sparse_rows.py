"""Sparse batch-1 fast paths that read only the rows of W they need.

    kept rows:  y = Σ_{i kept} x_i W_i   (W stored (d, O), so row i is what input i
                multiplies): magnitude sparsity's inputs
    kept dots:  y_o = W_o · x for kept o, else 0   (W stored (O, d)): CATS' kept
                output channels of up_proj

Each has two implementations with one signature:
  `kept_rows_matmul_xla`, `kept_dots_xla`: XLA needs static shapes, so the kept indices are gathered
    into one of a few bucket sizes: a lax.switch picks the smallest bucket that
    holds every kept input, and the unused slots are padded with zero inputs.  Rows
    are read in proportion to the bucket (at most 1/n_buckets of d more than the
    kept count), but XLA's CPU backend copies the gathered rows before its dot, so
    they are moved about three times (benchmarks/sparse_rows.py).  The last
    bucket, all d rows, is the masked product itself.
  the CPU kernel (`gsi_jax.ops.cpu_kernels`, float32): streams each kept row once.
`kept_rows_matmul` and `kept_dots` take the kernel where the program is lowered for
cpu in float32 and the kernel could be built, and the XLA path everywhere else.
On GPUs, at any batch, `gsi_jax.ops.kept_kernel` holds the Pallas kernels; `kept_product`
and CATS take them by the gate's impl (`by_impl`).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from gsi_jax.ops import cpu_kernels, kept_kernel
from gsi_jax.ops.gate import Gate, soft_keep, straight_through

N_BUCKETS = 8


def bucket_sizes(d: int, n_buckets: int = N_BUCKETS) -> tuple[int, ...]:
  """Ascending gather sizes, the last one d: ceil(d j / n) for j = 1..n."""
  return tuple(sorted({-(-d * j // n_buckets) for j in range(1, n_buckets + 1)}))


def _by_bucket(keep_D: jax.Array, n_buckets: int, masked, gathered):
  """lax.switch over the bucket sizes of `keep_D`: masked() where every row is read,
  else gathered(idx_S, valid_S) with the kept indices padded to the smallest bucket
  that holds them (valid_S False on the padding)."""
  d = keep_D.shape[0]
  sizes = bucket_sizes(d, n_buckets)
  count = jnp.sum(keep_D, dtype=jnp.int32)

  def branch(size):
    if size == d:  # every row: the masked product reads W in place, with no gathered copy
      return masked
    def run():
      idx = jnp.nonzero(keep_D, size=size, fill_value=0)[0]
      return gathered(idx, jnp.arange(size) < count)
    return run

  return lax.switch(jnp.searchsorted(jnp.asarray(sizes), count),  # the first size >= count
                    [branch(s) for s in sizes])


def kept_rows_matmul_xla(x_D: jax.Array, keep_D: jax.Array, Ws: Sequence[jax.Array],
                         n_buckets: int = N_BUCKETS) -> list[jax.Array]:
  """x·keep @ W for each W (d, O), reading only ~the kept rows; one token (x_D: (d,))."""
  def gathered(idx_S, valid_S):
    x_S = jnp.where(valid_S, x_D[idx_S], 0)
    return [x_S @ W[idx_S] for W in Ws]
  return _by_bucket(keep_D, n_buckets, lambda: [jnp.where(keep_D, x_D, 0) @ W for W in Ws],
                    gathered)


def kept_rows_matmul(x_D: jax.Array, keep_D: jax.Array, Ws: Sequence[jax.Array],
                     n_buckets: int = N_BUCKETS) -> list[jax.Array]:
  """The same product, through the CPU kernel where it applies (see the module)."""
  xla = lambda: kept_rows_matmul_xla(x_D, keep_D, Ws, n_buckets)
  float32 = x_D.dtype == jnp.float32 and all(W.dtype == jnp.float32 for W in Ws)
  if not float32 or not cpu_kernels.available():
    return xla()
  return lax.platform_dependent(
      cpu=lambda: cpu_kernels.kept_rows(x_D, keep_D.astype(bool), Ws),
      default=xla)


def kept_dots_xla(x_D: jax.Array, keep_O: jax.Array, W_OD: jax.Array,
                  n_buckets: int = N_BUCKETS) -> jax.Array:
  """y_o = W_o · x where keep_o, else 0, for W stored (O, d): only the kept rows are
  read (CATS' up projection, stored transposed, for the channels its gate keeps)."""
  def gathered(idx_S, valid_S):
    y_S = jnp.where(valid_S, W_OD[idx_S] @ x_D, 0)
    return jnp.zeros(W_OD.shape[0], y_S.dtype).at[idx_S].add(y_S)  # padding adds 0 to row 0
  return _by_bucket(keep_O, n_buckets, lambda: jnp.where(keep_O, W_OD @ x_D, 0), gathered)


def kept_dots(x_D: jax.Array, keep_O: jax.Array, W_OD: jax.Array,
              n_buckets: int = N_BUCKETS) -> jax.Array:
  """The same, through the CPU kernel where it applies (see the module)."""
  xla = lambda: kept_dots_xla(x_D, keep_O, W_OD, n_buckets)
  if x_D.dtype != jnp.float32 or W_OD.dtype != jnp.float32 or not cpu_kernels.available():
    return xla()
  return lax.platform_dependent(
      cpu=lambda: cpu_kernels.kept_dots(x_D, keep_O.astype(bool), W_OD), default=xla)


def reads_kept_rows(x_BTD: jax.Array, gate: Gate | None) -> bool:
  """Whether a sparse product reads only its kept rows: one token, under batch1_switch
  (elsewhere the masked product is the cheaper program)."""
  return gate is not None and gate.batch1_switch and x_BTD.shape[:-1] == (1, 1)


def magnitude_keep(x_BTD: jax.Array, threshold, gate: Gate | None) -> jax.Array:
  """|x| ≥ t: a bool mask, or in gate mode "soft" a float one (the hard mask forward,
  `soft_keep`'s gradient backward, so learning sees the hard model)."""
  keep_BTD = jnp.abs(x_BTD) >= threshold
  if gate is not None and gate.mode == "soft":
    return straight_through(keep_BTD, soft_keep(x_BTD, threshold))
  return keep_BTD


def by_impl(gate: Gate | None, kernel, xla):
  """kernel() where gate.impl asks for the Pallas kernels: "pallas" everywhere (interpreted
  on cpu), "auto" where the program is lowered for a GPU or TPU; xla() otherwise."""
  if gate is None or gate.impl == "xla":
    return xla()
  if gate.impl == "pallas":
    return kernel()
  return lax.platform_dependent(cpu=xla, default=kernel)


def kept_product(x_BTD: jax.Array, threshold, Ws: Sequence[jax.Array],
                 gate: Gate | None) -> tuple[list[jax.Array], jax.Array]:
  """([x·keep @ W for each W], keep), keep = |x| ≥ threshold (`magnitude_keep`).  Through
  the Pallas kernel (`by_impl`) every map of the site is one call that takes the threshold,
  masks x itself and reads only rows some token keeps, at any batch; on XLA, at one token
  under gate.batch1_switch only the kept rows are read (`kept_rows_matmul`), elsewhere the
  masked product.  A soft mask multiplies, so its gradient flows."""
  keep_BTD = magnitude_keep(x_BTD, threshold, gate)
  if keep_BTD.dtype != jnp.bool_:
    kept_BTD = x_BTD * keep_BTD.astype(x_BTD.dtype)
    return [kept_BTD @ W for W in Ws], keep_BTD
  lead, d = x_BTD.shape[:-1], x_BTD.shape[-1]

  def kernel():
    ys = kept_kernel.kept_rows(x_BTD.reshape(-1, d), threshold, Ws)
    return [y.reshape(*lead, -1) for y in ys]

  def xla():
    if reads_kept_rows(x_BTD, gate):
      return [y.reshape(1, 1, -1)
              for y in kept_rows_matmul(x_BTD.reshape(-1), keep_BTD.reshape(-1), Ws)]
    kept_BTD = jnp.where(keep_BTD, x_BTD, 0)
    return [kept_BTD @ W for W in Ws]

  return by_impl(gate, kernel, xla), keep_BTD
