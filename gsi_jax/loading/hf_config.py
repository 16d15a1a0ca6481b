"""Hugging Face config.json -> ModelConfig, one translator per family.

Every attribute of config.json must be either read here, or known not to
change inference (dropouts, token ids, training knobs): anything else is
rejected, so a checkpoint we would silently mis-run fails loudly instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from gsi_jax.errors import GSIError
from gsi_jax.models.config import ModelConfig

# Attributes that do not change a forward pass.
IGNORED = {
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype",
    "id2label", "label2id", "is_encoder_decoder", "model_type", "output_attentions",
    "output_hidden_states", "problem_type", "return_dict", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id",
    "decoder_start_token_id", "use_cache", "initializer_range", "init_std",
    "attn_pdrop", "embd_pdrop", "resid_pdrop", "dropout", "attention_dropout",
    "activation_dropout", "layerdrop", "summary_activation", "summary_first_dropout",
    "summary_proj_to_labels", "summary_type", "summary_use_proj", "task_specific_params",
    "gradient_checkpointing", "tokenizer_class", "prefix", "n_ctx", "max_position_embeddings",
    "pretraining_tp", "reorder_and_upcast_attn", "_attn_implementation_autoset",
    "use_return_dict", "torchscript", "tie_encoder_decoder", "pruned_heads",
    "finetuning_task", "keys_to_ignore_at_inference",
}

# Keys that a family's hub config.json carries, that transformers' config class does not
# declare and its modeling code never reads (tests/test_hub_configs.py checks both).  Each
# maps to the value that matches what transformers computes, or None where any value does:
# a config that states another value describes a model transformers would not run as
# stated, and is refused by name.
TRANSFORMERS_IGNORES: dict[str, dict[str, Any]] = {
    # Legacy OpenAI GPT keys in gpt2-medium/large/xl's configs.
    "gpt2": {"n_special": 0, "predict_special_tokens": None},
    # GPT-J always applies rotary embeddings and always scales attention by 1/sqrt(head_dim).
    "gptj": {"rotary": True, "scale_attn_weights": True},
    "opt": {},
    # nanotron's export keys (SmolLM2): its RoPE is transformers' halves layout, never
    # interleaved; transformers.js's own runtime settings.
    "llama": {"is_llama_config": None, "rope_interleaved": False,
              "transformers.js_config": None},
}

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "gelu": "gelu", "relu": "relu", "silu": "silu",
               "swish": "silu"}


class _Reader:
  """Reads config attributes and remembers which ones it read."""

  def __init__(self, raw: dict[str, Any], family: str):
    self.raw, self.family, self.seen = raw, family, set()

  def get(self, key, default=None):
    self.seen.add(key)
    return self.raw.get(key, default)

  def need(self, key):
    """A required positive integer attribute (a size or a count)."""
    value = self.get(key)
    if value is None:
      raise GSIError(f"{self.family} config lacks {key!r}; add it to config.json")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise GSIError(f"{self.family} config: {key}={value!r} must be a positive integer")
    return value

  def require(self, key, allowed, default=None):
    value = self.get(key, default)
    if value not in allowed:
      raise GSIError(f"{self.family} config: {key}={value!r} is not supported "
                     f"(supported: {sorted(map(repr, allowed))})")
    return value

  def activation(self, key, default):
    act = self.require(key, set(ACTIVATIONS), default)
    return ACTIVATIONS[act]

  def check_all_read(self):
    for key, computed in TRANSFORMERS_IGNORES[self.family].items():
      if key in self.raw:
        self.seen.add(key)
        if computed is not None and self.raw[key] != computed:
          raise GSIError(f"{self.family} config: {key}={self.raw[key]!r} is not what "
                         f"transformers computes ({key}={computed!r}: it ignores the key); "
                         "refusing a model that would not run as its config states")
    unknown = sorted(set(self.raw) - self.seen - IGNORED)
    if unknown:
      raise GSIError(f"{self.family} config has attributes this loader does not know: "
                     f"{unknown}; refusing to guess how they change the model")


def _gpt2(r: _Reader) -> ModelConfig:
  r.require("scale_attn_weights", {True}, True)
  r.require("scale_attn_by_inverse_layer_idx", {False}, False)
  r.require("add_cross_attention", {False}, False)
  r.require("tie_word_embeddings", {True}, True)
  d, h = r.need("n_embd"), r.need("n_head")
  return ModelConfig(
      family="gpt2", vocab_size=r.need("vocab_size"), d_model=d, n_layers=r.need("n_layer"),
      n_heads=h, n_kv_heads=h, head_dim=d // h,
      d_ff=r.get("n_inner") or 4 * d, activation=r.activation("activation_function", "gelu_new"),
      norm="layernorm", norm_eps=r.get("layer_norm_epsilon", 1e-5),
      learned_positions=r.need("n_positions"), attn_bias=True, attn_out_bias=True,
      mlp_bias=True, tied_embeddings=True)


def _gptj(r: _Reader) -> ModelConfig:
  r.require("tie_word_embeddings", {False}, False)
  d, h = r.need("n_embd"), r.need("n_head")
  r.get("n_positions")  # rotary: no table to size
  return ModelConfig(
      family="gptj", vocab_size=r.need("vocab_size"), d_model=d, n_layers=r.need("n_layer"),
      n_heads=h, n_kv_heads=h, head_dim=d // h, d_ff=r.get("n_inner") or 4 * d,
      activation=r.activation("activation_function", "gelu_new"), norm="layernorm",
      norm_eps=r.get("layer_norm_epsilon", 1e-5), rotary_dim=r.get("rotary_dim") or d // h,
      rope_interleaved=True, parallel_block=True, mlp_bias=True, lm_head_bias=True)


def _opt(r: _Reader) -> ModelConfig:
  r.require("tie_word_embeddings", {True}, True)
  r.require("layer_norm_elementwise_affine", {True}, True)
  d, h = r.need("hidden_size"), r.need("num_attention_heads")
  pre_norm = r.require("do_layer_norm_before", {True, False}, True)
  remove_final = r.require("_remove_final_layer_norm", {True, False}, False)
  bias = r.require("enable_bias", {True, False}, True)
  proj = r.get("word_embed_proj_dim") or d
  return ModelConfig(
      family="opt", vocab_size=r.need("vocab_size"), d_model=d,
      n_layers=r.need("num_hidden_layers"),
      n_heads=h, n_kv_heads=h, head_dim=d // h, d_ff=r.need("ffn_dim"),
      activation=r.activation("activation_function", "relu"), norm="layernorm", norm_eps=1e-5,
      learned_positions=r.raw.get("max_position_embeddings", 2048) + 2, position_offset=2,
      pre_norm=pre_norm, final_norm=pre_norm and not remove_final, attn_bias=bias,
      attn_out_bias=bias, mlp_bias=bias, tied_embeddings=True,
      embed_proj_dim=proj if proj != d else 0)


def _llama_rope(r: _Reader) -> tuple[float, tuple | None]:
  params = r.get("rope_parameters") or {}
  top = r.get("rope_theta")
  if top is not None and "rope_theta" in params and top != params["rope_theta"]:
    raise GSIError(f"llama config: rope_theta={top!r} and rope_parameters.rope_theta="
                   f"{params['rope_theta']!r} disagree; keep one")
  theta = params.get("rope_theta", 10000.0 if top is None else top)
  scaling = r.get("rope_scaling") or params
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind != "llama3":
    raise GSIError(f"llama config: rope type {kind!r} is not supported (default, llama3)")
  keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  return theta, tuple((k, float(scaling[k])) for k in keys)


def _llama(r: _Reader) -> ModelConfig:
  r.require("attention_bias", {False}, False)
  mlp_bias = r.require("mlp_bias", {True, False}, False)
  d, h = r.need("hidden_size"), r.need("num_attention_heads")
  theta, scaling = _llama_rope(r)
  return ModelConfig(
      family="llama", vocab_size=r.need("vocab_size"), d_model=d,
      n_layers=r.need("num_hidden_layers"), n_heads=h,
      n_kv_heads=r.get("num_key_value_heads") or h, head_dim=r.get("head_dim") or d // h,
      d_ff=r.need("intermediate_size"), activation=r.activation("hidden_act", "silu"),
      norm="rmsnorm", norm_eps=r.get("rms_norm_eps", 1e-6), gated_mlp=True,
      rope_theta=theta, rope_scaling=scaling, mlp_bias=mlp_bias,
      tied_embeddings=bool(r.get("tie_word_embeddings", False)))


TRANSLATORS: dict[str, Callable[[_Reader], ModelConfig]] = {
    "gpt2": _gpt2, "gptj": _gptj, "opt": _opt, "llama": _llama,
}


def config_from_hf(raw: dict[str, Any], name: str = "") -> ModelConfig:
  """config.json (as a dict) -> ModelConfig; unknown attributes are refused."""
  model_type = raw.get("model_type")
  if model_type not in TRANSLATORS:
    raise GSIError(f"model_type {model_type!r} is not supported; supported: "
                   f"{sorted(TRANSLATORS)}")
  if "quantization_config" in raw:
    method = (raw["quantization_config"] or {}).get("quant_method", "unnamed") \
        if isinstance(raw["quantization_config"], dict) else "unnamed"
    raise GSIError(f"{model_type} config has a quantization_config ({method}): quantized "
                   "Hugging Face checkpoints are not supported; load the float checkpoint "
                   "(or a GGUF file)")
  reader = _Reader(raw, model_type)
  try:
    config = TRANSLATORS[model_type](reader)
  except (TypeError, KeyError) as e:  # a required attribute is missing
    raise GSIError(f"{model_type} config is missing or has a malformed attribute: {e}") from None
  reader.check_all_read()
  return dataclasses.replace(config, name=name or config.name)
