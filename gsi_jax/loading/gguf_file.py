"""GGUF files (Llama architecture): config, dequantized weights, tokenizer."""

from __future__ import annotations

import os

import numpy as np

from gsi_jax.errors import GSIError
from gsi_jax.loading.mapping import TensorSource
from gsi_jax.models.config import ModelConfig

GGUF_MAGIC = b"GGUF"


def _gguf():
  """llama.cpp's reader, imported only to read a GGUF file: the rest of gsi_jax runs without
  it (a GPU image may not have it)."""
  try:
    import gguf
  except ImportError:
    raise GSIError("reading a .gguf file needs the gguf package; install it (pip install "
                   "gguf) or pass a Hugging Face folder") from None
  return gguf


def open_gguf(path: str):
  """A GGUFReader for `path`, after checking the magic and that no tensor runs past the end."""
  gguf = _gguf()
  with open(path, "rb") as f:
    if f.read(4) != GGUF_MAGIC:
      raise GSIError(f"{path} is not a GGUF file (bad magic); pass a .gguf model file")
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # the reader's own errors are not informative
    raise GSIError(f"{path}: cannot parse GGUF ({e}); the file is truncated or damaged") from None
  size = os.path.getsize(path)
  for t in reader.tensors:
    if t.data_offset + t.n_bytes > size:
      raise GSIError(f"{path}: tensor {t.name} runs past the end of the file; "
                     "the file is truncated, download it again")
  return reader


def _field(reader, key, default=None):
  field = reader.get_field(key)
  return default if field is None else field.contents()


def _number(reader, path: str, key: str, kind=int, default=None):
  """A numeric metadata field; a missing required one or a value of another type is named."""
  value = _field(reader, key, default)
  if value is None:
    raise GSIError(f"{path}: GGUF metadata lacks {key}; the file is incomplete")
  try:
    return kind(value)
  except (TypeError, ValueError):
    raise GSIError(f"{path}: GGUF metadata {key}={value!r} is not a number") from None


def config_from_gguf(reader, path: str) -> ModelConfig:
  """The ModelConfig of a Llama-architecture GGUF, from its metadata."""
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise GSIError(f"{path}: GGUF architecture {arch!r} is not supported (llama only)")
  a = "llama."
  d = _number(reader, path, a + "embedding_length")
  heads = _number(reader, path, a + "attention.head_count")
  if heads < 1:
    raise GSIError(f"{path}: GGUF metadata {a}attention.head_count={heads} must be positive")
  names = {t.name for t in reader.tensors}
  scaling = _field(reader, a + "rope.scaling.type")
  if scaling not in (None, "none"):
    raise GSIError(f"{path}: RoPE scaling {scaling!r} is not supported")
  tokens = reader.get_field("tokenizer.ggml.tokens")
  fields = dict(
      vocab_size=_number(reader, path, a + "vocab_size",
                         default=None if tokens is None else len(tokens.data)),
      n_layers=_number(reader, path, a + "block_count"),
      n_kv_heads=_number(reader, path, a + "attention.head_count_kv", default=heads),
      head_dim=_number(reader, path, a + "attention.key_length", default=d // heads),
      d_ff=_number(reader, path, a + "feed_forward_length"),
      norm_eps=_number(reader, path, a + "attention.layer_norm_rms_epsilon", float, 1e-5),
      rope_theta=_number(reader, path, a + "rope.freq_base", float, 10000.0))
  try:
    return ModelConfig(
        family="llama", d_model=d, n_heads=heads, activation="silu", norm="rmsnorm",
        gated_mlp=True, tied_embeddings="output.weight" not in names,
        name=str(_field(reader, "general.name", os.path.basename(path))), **fields)
  except GSIError as e:  # a value out of range: name the file too
    raise GSIError(f"{path}: {e}") from None


def tensor_getter(reader, path: str):
  """(tensor name -> dequantised float32 numpy array, every tensor name in the file)."""
  gguf = _gguf()
  tensors = {t.name: t for t in reader.tensors}

  def get(name: str) -> np.ndarray:
    if name not in tensors:
      raise GSIError(f"{path}: tensor {name} is missing; not a complete Llama GGUF")
    t = tensors[name]
    try:
      w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
      raise GSIError(f"{path}: quantization {t.tensor_type.name} of {name} is not supported "
                     "by the gguf package") from None
    return np.asarray(w, np.float32)
  return TensorSource(get, frozenset(tensors))


def tokenizer_from_gguf(reader, path: str):
  """A fast tokenizer built from the vocabulary and merges in the metadata.

  Byte-level BPE ("gpt2" tokenizer model) is built directly with `tokenizers`
  (under a second); other tokenizer models go through transformers' GGUF
  converter, which is slower.
  """
  model = _field(reader, "tokenizer.ggml.model")
  if model is None:
    return None
  if model != "gpt2":
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".",
                                         gguf_file=os.path.basename(path))
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  tokens = _field(reader, "tokenizer.ggml.tokens")
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
  types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
  tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                             ignore_merges=False))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  control, user = 3, 4  # llama.cpp token types
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, ty in zip(tokens, types) if ty == control])
  tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == user])

  def special(key):
    idx = _field(reader, f"tokenizer.ggml.{key}_token_id")
    return None if idx is None else tokens[int(idx)]
  return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special("bos"),
                                 eos_token=special("eos"), unk_token=special("unknown"),
                                 pad_token=special("padding"))
