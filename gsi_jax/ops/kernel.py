"""The gated matrix product as a Pallas kernel, beside its pure-JAX reference.

    y_t = g_t M   where token t is fast,   y_t = x_t W   where it is slow.

g = x V_k and the gate are computed once per token before the kernel (one read
of V_k; see `gsi_jax.ops.gated_linear`), so each program only streams weights:
it owns block_t tokens × block_o outputs and loops over the reduction
dimension with `lax.fori_loop` in tiles (block_k rows of M, block_d rows of W),
reading M's tiles only when one of its tokens is fast and W's only when one is
slow (`pl.when`).  No program holds more than a (block_d, block_o) tile, so the
Triton lowering fits a GPU's registers at GPT-J's shapes (d = 4096, O = 16384).

Block sizes are powers of two, as Triton requires.  Each is the largest one up
to its cap that divides the dimension (576 → 64), so a model's own widths need
no padding; a width that is not a multiple of 16 is zero-padded (a copy per
call), which changes no result.  Padded tokens are marked neither fast nor slow.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

FAST, SLOW, PADDING = 1, 0, -1
BLOCK_T, BLOCK_O, BLOCK_D, BLOCK_K = 16, 128, 512, 128


def tile(n: int, cap: int) -> int:
  """The largest power of two <= cap that divides n, and at least 16."""
  t = cap
  while t > 16 and n % t:
    t //= 2
  return t


def _pad(a: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
  extra = -a.shape[axis] % multiple
  if not extra:
    return a
  pads = [(0, 0)] * a.ndim
  pads[axis] = (0, extra)
  return jnp.pad(a, pads, constant_values=value)


def gated_matmul_reference(x_TD, g_TK, fast_T, M_KO, W, *, w_transposed: bool = False):
  """Pure JAX, same signature: both products, then a per-token select (float32 math).

  W is (d, O), or (O, d) when w_transposed (a tied LM head reads its table).
  """
  y_fast = jnp.dot(g_TK.astype(jnp.float32), M_KO.astype(jnp.float32))
  dims = (((1,), (1,)), ((), ())) if w_transposed else (((1,), (0,)), ((), ()))
  y_slow = lax.dot_general(x_TD.astype(jnp.float32), W.astype(jnp.float32), dims)
  return jnp.where(fast_T[:, None], y_fast, y_slow).astype(x_TD.dtype)


def _kernel(state_ref, x_ref, g_ref, M_ref, W_ref, y_ref, *, block_d, block_k, w_transposed):
  state = state_ref[...]  # (block_t, 1): FAST, SLOW or PADDING
  fast = state == FAST
  bt, bo = y_ref.shape
  zeros = jnp.zeros((bt, bo), jnp.float32)

  @pl.when(jnp.any(fast))
  def _fast():
    def body(i, acc):
      g = g_ref[:, pl.ds(i * block_k, block_k)].astype(jnp.float32)
      m = M_ref[pl.ds(i * block_k, block_k), :].astype(jnp.float32)
      return acc + jnp.dot(g, m, preferred_element_type=jnp.float32)
    y_ref[...] = lax.fori_loop(0, g_ref.shape[1] // block_k, body, zeros).astype(y_ref.dtype)

  @pl.when(jnp.any(state == SLOW))
  def _slow():
    def body(i, acc):
      x = x_ref[:, pl.ds(i * block_d, block_d)].astype(jnp.float32)
      if w_transposed:
        w = W_ref[:, pl.ds(i * block_d, block_d)].astype(jnp.float32)
        return acc + lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
      w = W_ref[pl.ds(i * block_d, block_d), :].astype(jnp.float32)
      return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
    y_slow = lax.fori_loop(0, x_ref.shape[1] // block_d, body, zeros).astype(y_ref.dtype)
    y_ref[...] = jnp.where(fast, y_ref[...], y_slow)


@functools.partial(jax.jit, static_argnames=("w_transposed", "block_t", "block_o", "block_d",
                                             "block_k", "interpret"))
def gated_matmul(x_TD, g_TK, fast_T, M_KO, W, *, w_transposed: bool = False,
                 block_t: int = BLOCK_T, block_o: int = BLOCK_O, block_d: int = BLOCK_D,
                 block_k: int = BLOCK_K, interpret: bool = False):
  """y (T, O) in x's dtype: g M on fast tokens, x W on slow ones; reads only what they need.

  block_d and block_k are caps: each tile is the largest power of two up to
  the cap that divides its dimension.
  """
  T, D = x_TD.shape
  K, O = M_KO.shape
  bd, bk, bo = tile(D, block_d), tile(K, block_k), tile(O, block_o)
  state = _pad(jnp.where(fast_T, FAST, SLOW).astype(jnp.int32)[:, None], 0, block_t, PADDING)
  x = _pad(_pad(x_TD, 0, block_t), 1, bd)
  g = _pad(_pad(g_TK.astype(jnp.float32), 0, block_t), 1, bk)
  M = _pad(_pad(M_KO, 0, bk), 1, bo)
  if w_transposed:
    W = _pad(_pad(W, 0, bo), 1, bd)
    w_spec = pl.BlockSpec((bo, W.shape[1]), lambda i, j: (j, 0))
  else:
    W = _pad(_pad(W, 0, bd), 1, bo)
    w_spec = pl.BlockSpec((W.shape[0], bo), lambda i, j: (0, j))
  Tp, Dp, Kp, Op = x.shape[0], x.shape[1], g.shape[1], M.shape[1]
  y = pl.pallas_call(
      functools.partial(_kernel, block_d=bd, block_k=bk, w_transposed=w_transposed),
      out_shape=jax.ShapeDtypeStruct((Tp, Op), x_TD.dtype),
      grid=(Tp // block_t, Op // bo),
      in_specs=[pl.BlockSpec((block_t, 1), lambda i, j: (i, 0)),
                pl.BlockSpec((block_t, Dp), lambda i, j: (i, 0)),
                pl.BlockSpec((block_t, Kp), lambda i, j: (i, 0)),
                pl.BlockSpec((Kp, bo), lambda i, j: (0, j)),
                w_spec],
      out_specs=pl.BlockSpec((block_t, bo), lambda i, j: (i, j)),
      interpret=interpret,
  )(state, x, g, M, W)
  return y[:T, :O]
