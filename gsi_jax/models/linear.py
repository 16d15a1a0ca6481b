"""The linear-map site: every map of a block goes through here.

A site holds every map that reads one input, dense or GSI depending on its
parameters (`gsi_jax.models.params` spells the layout).  `gsi_jax.apply_gsi`
and `gsi_jax.peers` add keys to the tree; the model code never changes.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from gsi_jax.models import params as P
from gsi_jax.ops import Gate, GatedWeights, gated_linear


def add_bias(y_BTO: jax.Array, b_O: jax.Array) -> jax.Array:
  return y_BTO + b_O.reshape((1,) * (y_BTO.ndim - 1) + b_O.shape)


def gated_weights(module: nn.Module, W: list, W_transposed: bool = False) -> GatedWeights:
  """The GSI weights a site or head module holds, in the order of W."""
  get = lambda key: module.get_variable("params", key) if module.has_variable("params", key) \
      else None
  names = sorted(get(P.M))
  sketch = get(P.SKETCH)
  return GatedWeights(W=W, V=get(P.V), M=[get(P.M)[n] for n in names],
                      sketch=None if sketch is None else (sketch, get(P.SKETCH_M)),
                      rungs=get(P.LADDER), W_transposed=W_transposed)


class LinearSite(nn.Module):
  """All maps reading one input; dense or GSI depending on the parameters."""
  outputs: tuple[tuple[str, int, bool], ...]  # (map, d_out, has bias)
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD: jax.Array, gate: Gate | None) -> dict[str, jax.Array]:
    d = x_BTD.shape[-1]
    init = nn.initializers.normal(0.02)
    kernel = self.param(P.KERNEL, lambda key: {
        n: init(jax.random.fold_in(key, i), (d, o), self.dtype)
        for i, (n, o, _) in enumerate(self.outputs)})
    self.sow(P.SITE_INPUTS, "x", x_BTD)  # calibration reads every site's input
    if self.has_variable("params", P.THRESHOLD):  # magnitude sparsity (a GSI peer)
      keep_BTD = jnp.abs(x_BTD) >= self.get_variable("params", P.THRESHOLD)
      self.sow("sparsity_stats", "kept", jnp.mean(keep_BTD, -1, dtype=jnp.float32))
      x_BTD = jnp.where(keep_BTD, x_BTD, 0)
    names = sorted(kernel)  # M/{map} is keyed alike
    if gate is None or gate.mode == "dense" or not self.has_variable("params", P.V):
      ys = [x_BTD @ kernel[n] for n in names]
    else:
      ys, fast_BT, rank_BT = gated_linear(
          x_BTD, gated_weights(self, [kernel[n] for n in names]), gate.eps, gate)
      self.sow("gate_stats", "fast", fast_BT)
      self.sow("gate_stats", "rank", rank_BT)  # V columns read (the ladder's bytes)
    biased = {n: o for n, o, has_bias in self.outputs if has_bias}
    if biased:
      bias = self.param(P.BIAS, lambda key: {
          n: jnp.zeros((o,), self.dtype) for n, o in biased.items()})
      ys = [add_bias(y, bias[n]) if n in bias else y for y, n in zip(ys, names)]
    return dict(zip(names, ys))


class LMHead(nn.Module):
  """Logits from the final hidden state; a tied head reads the embedding table.

  Same parameter names as nn.Dense ("kernel", "bias"), so checkpoints map
  unchanged.  `gsi_jax.apply_gsi_head` adds V and M (a tied head too), which
  gate the head like a site, at gate.head_eps (beyond the paper).
  """
  vocab_size: int
  use_bias: bool
  dtype: Any

  @nn.compact
  def __call__(self, x_BTD, table_VD, gate: Gate | None):
    if table_VD is None:
      W, transposed = self.param(P.KERNEL, nn.initializers.lecun_normal(),
                                 (x_BTD.shape[-1], self.vocab_size), self.dtype), False
    else:
      W, transposed = table_VD, True
    self.sow(P.HEAD_INPUTS, "x", x_BTD)
    if gate is None or gate.mode == "dense" or not self.has_variable("params", P.V):
      y_BTV = x_BTD @ (W.T if transposed else W)
    else:
      eps = gate.eps if gate.head_eps is None else gate.head_eps
      (y_BTV,), fast_BT, _ = gated_linear(x_BTD, gated_weights(self, [W], transposed), eps, gate)
      self.sow("head_stats", "fast", fast_BT)
    if self.use_bias:
      y_BTV = add_bias(y_BTV, self.param(P.BIAS, nn.initializers.zeros, (self.vocab_size,),
                                         self.dtype))
    return y_BTV
