"""Architecture description shared by every supported family.

One frozen dataclass covers GPT-2, GPT-J, OPT and the Llama family: the
families differ only in the switches below, so one decoder implementation
serves them all and the GSI transform sees the same parameter layout.
"""

from __future__ import annotations

import dataclasses

FAMILIES = ("gpt2", "gptj", "opt", "llama")
ACTIVATIONS = ("gelu_tanh", "gelu", "relu", "silu")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  family: str
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  activation: str
  norm: str  # "layernorm" | "rmsnorm"
  norm_eps: float
  gated_mlp: bool = False  # SwiGLU-style gate/up/down
  # Positions: learned table (GPT-2, OPT) or rotary (GPT-J, Llama).
  learned_positions: int = 0  # table rows; 0 means rotary
  position_offset: int = 0  # OPT reads row pos + 2
  rope_theta: float = 10000.0
  rotary_dim: int = 0  # dims of each head that rotate; 0 means all
  rope_interleaved: bool = False  # GPT-J rotates adjacent pairs
  # Llama-3 style long-context frequency scaling; None for plain RoPE.
  rope_scaling: tuple[tuple[str, float], ...] | None = None
  parallel_block: bool = False  # GPT-J: attention and MLP read one norm
  pre_norm: bool = True  # False for OPT-350m's post-LayerNorm blocks
  final_norm: bool = True
  attn_bias: bool = False
  attn_out_bias: bool = False
  mlp_bias: bool = False
  norm_bias: bool = True  # LayerNorm with a bias (not used by RMSNorm)
  tied_embeddings: bool = False
  lm_head_bias: bool = False
  embed_proj_dim: int = 0  # OPT-350m: embeddings narrower than d_model
  name: str = ""

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"family {self.family!r} not in {FAMILIES}")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation {self.activation!r} not in {ACTIVATIONS}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError("n_heads must be a multiple of n_kv_heads")

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
