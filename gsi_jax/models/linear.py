"""The linear-map site: every map of a block goes through here.

A *site* is the set of linear maps that read one input (q/k/v read the same
normed hidden state; GPT-J's fc_in reads it too).  Its parameters are

  dense:  {"kernel": {map: W_DO}, "bias": {map: b_O}}
  GSI:    the same plus "basis": V_DK and "image": M_KO = V^T [W_1 | W_2 | ...]
          (all maps fused along the output axis, in sorted map-name order), so
          g = V^T x and the gate are computed once per site; optionally
          "sketch"/"sketch_image" for the output-aware gate and "ladder"
          (nested ranks k_1 < ... < k) for the rank ladder.
  peer:   "threshold" zeroes inputs with |x| below it (magnitude sparsity).

`gsi_jax.apply_gsi` and `gsi_jax.peers` add these; the model code never changes.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from gsi_jax.errors import GSIError

GATE_MODES = ("gated", "static", "dense")


@flax.struct.dataclass
class Gate:
  """How GSI sites compute their outputs.

  eps is traced (sweeping it does not recompile); the mode and the batch-1
  residual skip are static.  head_eps gates a GSI LM head (None: eps).
  """
  eps: jax.Array
  head_eps: jax.Array | None = None
  mode: str = flax.struct.field(pytree_node=False, default="gated")
  # Run only the branch the call's gate pattern needs (lax.switch), so W's
  # bytes are read only when some token is slow.  Exact; pays off at batch 1.
  skip_residual: bool = flax.struct.field(pytree_node=False, default=False)


def _threshold(name: str, value: float) -> jax.Array:
  value = float(value)
  if value != value or value < 0:
    raise GSIError(f"{name} must be a number >= 0 (inf allowed), got {value}")
  return jnp.asarray(value, jnp.float32)


def make_gate(eps: float, mode: str = "gated", skip_residual: bool = False,
              head_eps: float | None = None) -> Gate:
  if mode not in GATE_MODES:
    raise GSIError(f"gate mode {mode!r} is not one of {GATE_MODES}")
  return Gate(eps=_threshold("eps", eps),
              head_eps=None if head_eps is None else _threshold("head_eps", head_eps),
              mode=mode, skip_residual=skip_residual)


def split_outputs(y_BTO: jax.Array, sizes: tuple[int, ...]) -> list[jax.Array]:
  bounds = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
  return jnp.split(y_BTO, bounds, axis=-1)


def gate_mask(x_BTD, g_BTK, eps):
  """rho < eps, with ||r||^2 = ||x||^2 - ||g||^2 (V orthonormal): V is read once.

  Written without a division; eps = 0 is never fast, eps = inf always.
  """
  xx = jnp.sum(jnp.square(x_BTD.astype(jnp.float32)), -1)
  gg = jnp.sum(jnp.square(g_BTK.astype(jnp.float32)), -1)
  return (xx - gg < jnp.square(eps) * xx) & (eps > 0)


def output_gate_mask(x_BTD, g_BTK, C_DS, D_KS, eps):
  """Output-aware gate: ||W r|| < eps ||W x||, both norms read through a sketch.

  C = W Omega and D = V^T C for a random Omega with s orthonormal columns,
  so x C - g D = r W Omega and x C = x W Omega: s columns stand in for O.
  """
  xc = (x_BTD @ C_DS).astype(jnp.float32)
  e = xc - (g_BTK @ D_KS).astype(jnp.float32)
  return (jnp.sum(e * e, -1) < jnp.square(eps) * jnp.sum(xc * xc, -1)) & (eps > 0)


def ladder_ranks(x_BTD, g_BTK, rungs_R, eps):
  """Rank ladder: per token, the smallest rung k_j with ||r_j|| < eps ||x||.

  Bases are nested (V_{k_j} is the first k_j columns of V), so
  ||r_j||^2 = ||x||^2 - ||g[:k_j]||^2 for every rung from one cumulative sum.
  Returns the fast mask and the rank used, (B, T) each; a slow token's rank
  is the top rung, having been through all of V.
  """
  xx = jnp.sum(jnp.square(x_BTD.astype(jnp.float32)), -1)[..., None]
  gg_BTR = jnp.cumsum(jnp.square(g_BTK.astype(jnp.float32)), -1)[..., rungs_R - 1]
  pass_BTR = (xx - gg_BTR < jnp.square(eps) * xx) & (eps > 0)
  fast_BT = jnp.any(pass_BTR, -1)
  rank_BT = jnp.where(fast_BT, rungs_R[jnp.argmax(pass_BTR, -1)], rungs_R[-1])
  return fast_BT, rank_BT


def gated_outputs(x_BTD, kernels, V_DK, M_KO, eps, *, static, skip_residual, sketch=None,
                  rungs=None):
  """Per-token GSI: M g on fast tokens, W x on slow ones.

  A masked select, so under XLA both branches are computed, unless
  skip_residual: then a three-way lax.switch on the call's gate pattern runs
  only M g (all fast), only W x (all slow) or both (mixed).  At batch-1
  decoding the mixed case cannot occur, so a step reads V and M, or V and W.
  sketch: (C_DS, D_KS) switches to the output-aware gate; rungs (R,) int to
  the rank ladder (g's entries past a token's rung are zeroed, so M g reads
  as M's first k_j rows; under XLA V and M are still read whole).
  Returns the outputs per map (in kernels' order), the fast mask (B, T) and
  the rank each token used (B, T) (k everywhere without a ladder).
  """
  sizes = tuple(W.shape[1] for W in kernels)
  g_BTK = x_BTD @ V_DK
  rank_BT = jnp.full(x_BTD.shape[:-1], V_DK.shape[1], jnp.int32)

  if static:
    return split_outputs(g_BTK @ M_KO, sizes), jnp.ones(x_BTD.shape[:-1], bool), rank_BT
  if rungs is not None:
    fast_BT, rank_BT = ladder_ranks(x_BTD, g_BTK, rungs, eps)
    g_BTK = jnp.where(jnp.arange(V_DK.shape[1]) < rank_BT[..., None], g_BTK, 0)
  elif sketch is None:
    fast_BT = gate_mask(x_BTD, g_BTK, eps)
  else:
    fast_BT = output_gate_mask(x_BTD, g_BTK, *sketch, eps)

  def fast():
    return split_outputs(g_BTK @ M_KO, sizes)

  def slow():
    return [x_BTD @ W for W in kernels]

  def mixed():
    return [jnp.where(fast_BT[..., None], f, s) for f, s in zip(fast(), slow())]

  if not skip_residual:
    return mixed(), fast_BT, rank_BT
  branch = jnp.where(jnp.all(fast_BT), 0, jnp.where(jnp.any(fast_BT), 1, 2))
  return jax.lax.switch(branch, [fast, mixed, slow]), fast_BT, rank_BT


class LinearSite(nn.Module):
  """All maps reading one input; dense or GSI depending on the parameters."""
  outputs: tuple[tuple[str, int, bool], ...]  # (map, d_out, has bias)
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD: jax.Array, gate: Gate | None) -> dict[str, jax.Array]:
    d = x_BTD.shape[-1]
    init = nn.initializers.normal(0.02)
    kernel = self.param("kernel", lambda key: {
        n: init(jax.random.fold_in(key, i), (d, o), self.dtype)
        for i, (n, o, _) in enumerate(self.outputs)})
    # Calibration reads every site's input from this collection.
    self.sow("site_inputs", "x", x_BTD)
    if self.has_variable("params", "threshold"):  # magnitude sparsity (a GSI peer)
      keep_BTD = jnp.abs(x_BTD) >= self.get_variable("params", "threshold")
      self.sow("sparsity_stats", "kept", jnp.mean(keep_BTD, -1, dtype=jnp.float32))
      x_BTD = jnp.where(keep_BTD, x_BTD, 0)
    # The image M stacks the maps' columns in sorted name order (pytree order).
    names = sorted(kernel)
    gsi = self.has_variable("params", "basis")
    if gate is None or gate.mode == "dense" or not gsi:
      ys = [x_BTD @ kernel[n] for n in names]
    else:
      ys, fast_BT, rank_BT = gated_outputs(
          x_BTD, [kernel[n] for n in names],
          self.get_variable("params", "basis"),
          self.get_variable("params", "image"), gate.eps,
          static=gate.mode == "static", skip_residual=gate.skip_residual,
          sketch=(self.get_variable("params", "sketch"),
                  self.get_variable("params", "sketch_image"))
          if self.has_variable("params", "sketch") else None,
          rungs=self.get_variable("params", "ladder")
          if self.has_variable("params", "ladder") else None)
      self.sow("gate_stats", "fast", fast_BT)
      # Columns of V read per token (ladder: up to its rung), for byte accounting.
      self.sow("gate_stats", "rank", rank_BT)
    biased = {n: o for n, o, has_bias in self.outputs if has_bias}
    if biased:
      bias = self.param("bias", lambda key: {
          n: jnp.zeros((o,), self.dtype) for n, o in biased.items()})
      ys = [y + bias[n] if n in bias else y for y, n in zip(ys, names)]
    return dict(zip(names, ys))
