"""One decoder for GPT-2, GPT-J, OPT and Llama, driven by ModelConfig.

Parameters are a plain pytree: embed, pos_embed, layer_{i}/{attn_norm,
attn_in, attn_out, mlp_norm, mlp_in, mlp_out}, final_norm, lm_head.
GPT-J's parallel block has no mlp_in site: fc_in lives in attn_in, since it
reads the same normed input as q/k/v.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from einops import rearrange

from gsi_jax.models.activations import activation
from gsi_jax.models.config import ModelConfig
from gsi_jax.models.linear import LinearSite, LMHead
from gsi_jax.models.params import layer_name
from gsi_jax.ops import Gate


class LayerCache(NamedTuple):
  k_BSKH: jax.Array  # (batch, max_len, kv_heads, head_dim)
  v_BSKH: jax.Array


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype) -> tuple[LayerCache, ...]:
  shape = (batch, max_len, config.n_kv_heads, config.head_dim)
  return tuple(LayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
               for _ in range(config.n_layers))


def rope_frequencies(config: ModelConfig) -> jax.Array:
  rot = config.rotary_dim or config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
  if config.rope_scaling:  # Llama 3: stretch low frequencies, keep high ones
    s = dict(config.rope_scaling)
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    wavelen = 2 * jnp.pi / inv_freq
    smooth = ((s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"])
              / (s["high_freq_factor"] - s["low_freq_factor"]))
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
    mid = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv_freq = jnp.where(in_band, mid, scaled)
  return inv_freq


def apply_rope(x_BTNH: jax.Array, positions_T: jax.Array, config: ModelConfig) -> jax.Array:
  """HF Llama layout rotates halves; GPT-J rotates adjacent pairs of rotary_dim."""
  rot = config.rotary_dim or config.head_dim
  angles_TF = positions_T.astype(jnp.float32)[:, None] * rope_frequencies(config)[None]
  sin, cos = jnp.sin(angles_TF)[None, :, None], jnp.cos(angles_TF)[None, :, None]
  x_rot, x_pass = x_BTNH[..., :rot].astype(jnp.float32), x_BTNH[..., rot:]
  if config.rope_interleaved:
    x1, x2 = x_rot[..., ::2], x_rot[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).reshape(x_rot.shape)
  else:
    x1, x2 = jnp.split(x_rot, 2, -1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  return jnp.concatenate([out.astype(x_BTNH.dtype), x_pass], -1)


def attend(q_BTNH, k_BSKH, v_BSKH, q_pos_T, k_pos_S):
  """Causal grouped-query attention in float32."""
  H = q_BTNH.shape[-1]
  # Query heads come in groups of N / K that share one KV head.
  q = rearrange(q_BTNH, "b t (k g) h -> b t k g h", k=k_BSKH.shape[2]).astype(jnp.float32)
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k_BSKH.astype(jnp.float32)) / jnp.sqrt(H)
  mask_11TS = (k_pos_S[None, :] <= q_pos_T[:, None])[None, None, None]
  scores = jnp.where(mask_11TS, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BSKH.astype(jnp.float32))
  return rearrange(out, "b t k g h -> b t (k g h)").astype(q_BTNH.dtype)


class Norm(nn.Module):
  config: ModelConfig
  dtype: Any

  @nn.compact
  def __call__(self, x):
    c = self.config
    if c.norm == "rmsnorm":
      return nn.RMSNorm(epsilon=c.norm_eps, dtype=self.dtype, param_dtype=self.dtype,
                        name="norm")(x)
    return nn.LayerNorm(epsilon=c.norm_eps, use_bias=c.norm_bias, dtype=self.dtype,
                        param_dtype=self.dtype, name="norm")(x)


class Block(nn.Module):
  config: ModelConfig
  dtype: Any

  def _site(self, name, outputs, activation_name=None):
    return LinearSite(outputs=outputs, dtype=self.dtype, activation=activation_name, name=name)

  @nn.compact
  def __call__(self, x_BTD, positions_T, start, cache: LayerCache | None, gate: Gate | None):
    c = self.config
    qkv = (("q", c.q_dim, c.attn_bias), ("k", c.kv_dim, c.attn_bias),
           ("v", c.kv_dim, c.attn_bias))
    if c.gated_mlp:
      mlp_in = (("gate", c.d_ff, c.mlp_bias), ("up", c.d_ff, c.mlp_bias))
      mlp_out = (("down", c.d_model, c.mlp_bias),)
    else:
      mlp_in, mlp_out = (("fc_in", c.d_ff, c.mlp_bias),), (("fc_out", c.d_model, c.mlp_bias),)

    def attention(out, cache):
      B, T, _ = x_BTD.shape
      q = out["q"].reshape(B, T, c.n_heads, c.head_dim)
      k = out["k"].reshape(B, T, c.n_kv_heads, c.head_dim)
      v = out["v"].reshape(B, T, c.n_kv_heads, c.head_dim)
      if c.uses_rope:
        q, k = apply_rope(q, positions_T, c), apply_rope(k, positions_T, c)
      if cache is None:
        k_all, v_all, k_pos = k, v, positions_T
      else:
        idx = (0, start, 0, 0)
        cache = LayerCache(jax.lax.dynamic_update_slice(cache.k_BSKH, k.astype(cache.k_BSKH.dtype), idx),
                           jax.lax.dynamic_update_slice(cache.v_BSKH, v.astype(cache.v_BSKH.dtype), idx))
        k_all, v_all = cache
        k_pos = jnp.arange(k_all.shape[1])
      a = attend(q, k_all, v_all, positions_T, k_pos)
      return self._site("attn_out", (("o", c.d_model, c.attn_out_bias),))(a, gate)["o"], cache

    def mlp(h, out=None):
      if out is None:
        # A gated MLP's input site knows the activation: CATS thresholds act(x W_gate).
        out = self._site("mlp_in", mlp_in, c.activation if c.gated_mlp else None)(h, gate)
      if c.gated_mlp:
        z = activation(c.activation, out["gate"]) * out["up"]
      else:
        z = activation(c.activation, out["fc_in"])
      return self._site("mlp_out", mlp_out)(z, gate)[mlp_out[0][0]]

    attn_norm = Norm(c, self.dtype, name="attn_norm")
    if c.parallel_block:
      h = attn_norm(x_BTD)
      out = self._site("attn_in", qkv + mlp_in)(h, gate)
      a, cache = attention(out, cache)
      return x_BTD + a + mlp(h, out), cache
    mlp_norm = Norm(c, self.dtype, name="mlp_norm")
    if c.pre_norm:
      a, cache = attention(self._site("attn_in", qkv)(attn_norm(x_BTD), gate), cache)
      x_BTD = x_BTD + a
      return x_BTD + mlp(mlp_norm(x_BTD)), cache
    a, cache = attention(self._site("attn_in", qkv)(x_BTD, gate), cache)
    x_BTD = attn_norm(x_BTD + a)
    return mlp_norm(x_BTD + mlp(x_BTD)), cache


class Decoder(nn.Module):
  """Submodules are declared in setup so that calibration can run the input
  embedding on its own (`embed_inputs`) and then one `Block` at a time."""
  config: ModelConfig
  dtype: Any = jnp.float32

  def setup(self):
    c, dt = self.config, self.dtype
    self.embed = nn.Embed(c.vocab_size, c.embed_dim, dtype=dt, param_dtype=dt)
    if c.embed_proj_dim:
      self.project_in = nn.Dense(c.d_model, use_bias=False, dtype=dt, param_dtype=dt)
      self.project_out = nn.Dense(c.embed_dim, use_bias=False, dtype=dt, param_dtype=dt)
    if c.learned_positions:
      self.pos_embed = nn.Embed(c.learned_positions, c.d_model, dtype=dt, param_dtype=dt)
    for i in range(c.n_layers):
      setattr(self, layer_name(i), Block(c, dt))
    if c.final_norm:
      self.final_norm = Norm(c, dt)
    self.lm_head = LMHead(c.vocab_size, c.lm_head_bias, dt)

  def embed_inputs(self, ids_BT, start=0):
    """Layer 0's input: token (and learned position) embeddings."""
    c = self.config
    x = self.embed(ids_BT)
    if c.embed_proj_dim:
      x = self.project_in(x)
    if c.learned_positions:
      positions_T = start + jnp.arange(ids_BT.shape[1])
      x = x + self.pos_embed(positions_T + c.position_offset)[None]
    return x

  def __call__(self, ids_BT, start=0, cache=None, gate: Gate | None = None):
    """Logits (B, T, vocab) in float32 and the updated cache (None if none given)."""
    c = self.config
    positions_T = start + jnp.arange(ids_BT.shape[1])
    x = self.embed_inputs(ids_BT, start)
    new_cache = []
    for i in range(c.n_layers):
      x, layer_cache = getattr(self, layer_name(i))(
          x, positions_T, start, None if cache is None else cache[i], gate)
      new_cache.append(layer_cache)
    if c.final_norm:
      x = self.final_norm(x)
    if c.embed_proj_dim:
      x = self.project_out(x)
    logits = self.lm_head(x, self.embed.embedding if c.tied_embeddings else None, gate)
    return logits.astype(jnp.float32), (None if cache is None else tuple(new_cache))
