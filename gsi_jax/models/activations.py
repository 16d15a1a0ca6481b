"""The MLP activations by their config names (the decoder's MLP and CATS' gate use them)."""

from __future__ import annotations

import flax.linen as nn
import jax


def activation(name: str, x: jax.Array) -> jax.Array:
  if name == "gelu_tanh":
    return nn.gelu(x, approximate=True)
  if name == "gelu":
    return nn.gelu(x, approximate=False)
  if name == "relu":
    return nn.relu(x)
  return nn.silu(x)
