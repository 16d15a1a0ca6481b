"""Fused gated linear for a block of tokens, as a Pallas kernel, beside its reference.

    y = M g  where rho < eps,   y = W x  elsewhere,   g = V^T x,
    rho^2 = ||x - V g||^2 / ||x||^2 = 1 - ||g||^2 / ||x||^2   (V orthonormal)

The kernel tiles tokens (block_t) and outputs (block_o).  Each program
computes g and the gate for its tokens, then reads its tile of M only when
one of its tokens is fast and its tile of W only when one is slow (`pl.when`
inside the kernel; no per-token `lax.cond` outside it).  On the Triton
backend a ref is loaded where it is read, so an all-fast block never reads
W's bytes and an all-slow block never reads M's.
It lowers through Pallas's Triton backend (CUDA and ROCm); block sizes are
powers of two as Triton requires, and inputs are zero-padded to fit, which
changes no result (zero rows of V and columns of x add nothing).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gsi_jax.models.linear import gate_mask


def gated_linear_reference(x_TD, V_DK, M_KO, W_DO, eps):
  """Pure JAX, same signature: (y_TO, fast_T)."""
  x32 = x_TD.astype(jnp.float32)
  g = jnp.dot(x32, V_DK.astype(jnp.float32))
  fast = gate_mask(x32, g, eps)
  y_fast = jnp.dot(g, M_KO.astype(jnp.float32))
  y_slow = jnp.dot(x32, W_DO.astype(jnp.float32))
  return jnp.where(fast[:, None], y_fast, y_slow).astype(x_TD.dtype), fast


def _kernel(eps_ref, x_ref, V_ref, M_ref, W_ref, y_ref, fast_ref):
  x = x_ref[...].astype(jnp.float32)
  V = V_ref[...].astype(jnp.float32)
  g = jnp.dot(x, V)
  eps = eps_ref[0, 0]
  xx = jnp.sum(x * x, axis=1)
  fast = (xx - jnp.sum(g * g, axis=1) < eps * eps * xx) & (eps > 0)  # as gate_mask
  fast_ref[...] = fast[:, None].astype(jnp.int32)
  # M's tile is read only if some token is fast, W's only if some token is slow.

  @pl.when(jnp.any(fast))
  def _fast():
    y_ref[...] = jnp.dot(g, M_ref[...].astype(jnp.float32)).astype(y_ref.dtype)

  @pl.when(jnp.any(jnp.logical_not(fast)))
  def _slow():
    y_slow = jnp.dot(x, W_ref[...].astype(jnp.float32)).astype(y_ref.dtype)
    y_ref[...] = jnp.where(fast[:, None], y_ref[...], y_slow)


def _pad_to(a, axis, multiple):
  size = a.shape[axis]
  target = -(-size // multiple) * multiple
  if target == size:
    return a
  pads = [(0, 0)] * a.ndim
  pads[axis] = (0, target - size)
  return jnp.pad(a, pads)


def _pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


@functools.partial(jax.jit, static_argnames=("block_t", "block_o", "interpret"))
def gated_linear(x_TD, V_DK, M_KO, W_DO, eps, *, block_t: int = 16, block_o: int = 128,
                 interpret: bool = False):
  """(y_TO, fast_T), equal to gated_linear_reference up to float rounding."""
  T, D = x_TD.shape
  K, O = M_KO.shape
  d_pad, k_pad = _pow2(D), _pow2(K)
  x = _pad_to(_pad_to(x_TD, 0, block_t), 1, d_pad)
  V = _pad_to(_pad_to(V_DK, 0, d_pad), 1, k_pad)
  M = _pad_to(_pad_to(M_KO, 0, k_pad), 1, block_o)
  W = _pad_to(_pad_to(W_DO, 0, d_pad), 1, block_o)
  Tp, Op = x.shape[0], M.shape[1]
  eps_11 = jnp.asarray(eps, jnp.float32).reshape(1, 1)
  y, fast = pl.pallas_call(
      _kernel,
      out_shape=(jax.ShapeDtypeStruct((Tp, Op), x_TD.dtype),
                 jax.ShapeDtypeStruct((Tp, 1), jnp.int32)),
      grid=(Tp // block_t, Op // block_o),
      in_specs=[pl.BlockSpec((1, 1), lambda i, j: (0, 0)),
                pl.BlockSpec((block_t, d_pad), lambda i, j: (i, 0)),
                pl.BlockSpec((d_pad, k_pad), lambda i, j: (0, 0)),
                pl.BlockSpec((k_pad, block_o), lambda i, j: (0, j)),
                pl.BlockSpec((d_pad, block_o), lambda i, j: (0, j))],
      out_specs=(pl.BlockSpec((block_t, block_o), lambda i, j: (i, j)),
                 pl.BlockSpec((block_t, 1), lambda i, j: (i, 0))),
      interpret=interpret,
  )(eps_11, x, V, M, W)
  return y[:T, :O], fast[:T, 0].astype(bool)
