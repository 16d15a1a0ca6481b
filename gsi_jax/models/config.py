"""Architecture description shared by every supported family.

One frozen dataclass covers GPT-2, GPT-J, OPT and the Llama family: the
families differ only in the switches below, so one decoder implementation
serves them all and the GSI transform sees the same parameter layout.
"""

from __future__ import annotations

import dataclasses
import math

from gsi_jax.errors import GSIError

FAMILIES = ("gpt2", "gptj", "opt", "llama")
ACTIVATIONS = ("gelu_tanh", "gelu", "relu", "silu")
NORMS = ("layernorm", "rmsnorm")
_POSITIVE_INTS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff")
_COUNTS = ("learned_positions", "position_offset", "rotary_dim", "embed_proj_dim")
_POSITIVE_FLOATS = ("norm_eps", "rope_theta")
_SWITCHES = ("gated_mlp", "rope_interleaved", "parallel_block", "pre_norm", "final_norm",
             "attn_bias", "attn_out_bias", "mlp_bias", "norm_bias", "tied_embeddings",
             "lm_head_bias")


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_positive_float(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """One architecture.  Fields:

  family: "gpt2", "gptj", "opt" or "llama".
  vocab_size: rows of the embedding table.
  d_model: width of the residual stream.
  n_layers: transformer blocks.
  n_heads: query heads.
  n_kv_heads: key/value heads (fewer than n_heads: grouped-query attention).
  head_dim: width of one head.
  d_ff: hidden width of the MLP.
  activation: "gelu_tanh", "gelu", "relu" or "silu".
  norm: "layernorm" or "rmsnorm".
  norm_eps: the norms' epsilon.
  gated_mlp: SwiGLU-style gate/up/down instead of fc_in/fc_out.
  learned_positions: rows of a learned position table; 0 means rotary.
  position_offset: OPT reads position row pos + 2.
  rope_theta: rotary base frequency.
  rotary_dim: dims of each head that rotate; 0 means all.
  rope_interleaved: GPT-J rotates adjacent pairs (Llama rotates halves).
  rope_scaling: Llama-3 long-context frequency scaling, as (key, value) pairs; None for plain.
  parallel_block: GPT-J: attention and MLP read one norm and add in parallel.
  pre_norm: False for OPT-350m's post-LayerNorm blocks.
  final_norm: a norm before the LM head.
  attn_bias: q/k/v have biases.
  attn_out_bias: the attention output map has a bias.
  mlp_bias: the MLP maps have biases.
  norm_bias: LayerNorm has a bias (RMSNorm never does).
  tied_embeddings: the LM head reads the embedding table.
  lm_head_bias: the LM head has a bias (GPT-J).
  embed_proj_dim: OPT-350m: embeddings narrower than d_model, projected in and out; 0: none.
  name: a label for reports.
  """
  family: str
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  activation: str
  norm: str
  norm_eps: float
  gated_mlp: bool = False
  learned_positions: int = 0
  position_offset: int = 0
  rope_theta: float = 10000.0
  rotary_dim: int = 0
  rope_interleaved: bool = False
  rope_scaling: tuple[tuple[str, float], ...] | None = None
  parallel_block: bool = False
  pre_norm: bool = True
  final_norm: bool = True
  attn_bias: bool = False
  attn_out_bias: bool = False
  mlp_bias: bool = False
  norm_bias: bool = True
  tied_embeddings: bool = False
  lm_head_bias: bool = False
  embed_proj_dim: int = 0
  name: str = ""

  def __post_init__(self):
    """Every field typed and in range: a config that cannot be right never runs."""
    def bad(field, want):
      raise GSIError(f"model config: {field}={getattr(self, field)!r} is invalid; it must be "
                     f"{want} (fix the model's config)")
    for name, allowed in (("family", FAMILIES), ("activation", ACTIVATIONS), ("norm", NORMS)):
      if getattr(self, name) not in allowed:
        bad(name, f"one of {allowed}")
    for name in _POSITIVE_INTS:
      if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
        bad(name, "a positive integer")
    for name in _COUNTS:
      if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
        bad(name, "an integer >= 0")
    for name in _POSITIVE_FLOATS:
      if not _is_positive_float(getattr(self, name)):
        bad(name, "a finite number > 0")
    for name in _SWITCHES:
      if not isinstance(getattr(self, name), bool):
        bad(name, "true or false")
    if not isinstance(self.name, str):
      bad("name", "a string")
    if self.n_heads % self.n_kv_heads:
      bad("n_kv_heads", f"a divisor of n_heads={self.n_heads}")
    if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
      bad("rotary_dim", f"even and at most head_dim={self.head_dim} (0: all)")
    if self.family != "llama" and self.q_dim != self.d_model:
      bad("n_heads", f"such that n_heads x head_dim = d_model={self.d_model}")
    if self.rope_scaling is not None and not all(
        isinstance(k, str) and _is_positive_float(v) for k, v in self.rope_scaling):
      bad("rope_scaling", "(name, finite number > 0) pairs")

  @property
  def q_dim(self) -> int:
    return self.n_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.n_kv_heads * self.head_dim

  @property
  def embed_dim(self) -> int:
    return self.embed_proj_dim or self.d_model

  @property
  def uses_rope(self) -> bool:
    return self.learned_positions == 0

  # Named presets of the paper's models and the project's default model.
  @classmethod
  def gpt2_124m(cls) -> ModelConfig:
    return cls(family="gpt2", vocab_size=50257, d_model=768, n_layers=12,
               n_heads=12, n_kv_heads=12, head_dim=64, d_ff=3072,
               activation="gelu_tanh", norm="layernorm", norm_eps=1e-5,
               learned_positions=1024, attn_bias=True, attn_out_bias=True,
               mlp_bias=True, tied_embeddings=True, name="gpt2-124m")

  @classmethod
  def gptj_6b(cls) -> ModelConfig:
    return cls(family="gptj", vocab_size=50400, d_model=4096, n_layers=28,
               n_heads=16, n_kv_heads=16, head_dim=256, d_ff=16384,
               activation="gelu_tanh", norm="layernorm", norm_eps=1e-5,
               rotary_dim=64, rope_interleaved=True, parallel_block=True,
               mlp_bias=True, lm_head_bias=True, name="gptj-6b")

  @classmethod
  def opt_6_7b(cls) -> ModelConfig:
    return cls(family="opt", vocab_size=50272, d_model=4096, n_layers=32,
               n_heads=32, n_kv_heads=32, head_dim=128, d_ff=16384,
               activation="relu", norm="layernorm", norm_eps=1e-5,
               learned_positions=2050, position_offset=2, attn_bias=True,
               attn_out_bias=True, mlp_bias=True, tied_embeddings=True,
               name="opt-6.7b")

  @classmethod
  def smollm2_135m(cls) -> ModelConfig:
    return cls(family="llama", vocab_size=49152, d_model=576, n_layers=30,
               n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536,
               activation="silu", norm="rmsnorm", norm_eps=1e-5,
               gated_mlp=True, rope_theta=100000.0, tied_embeddings=True,
               name="smollm2-135m")
