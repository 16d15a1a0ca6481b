"""GGUF files (Llama architecture): config, dequantized weights, tokenizer."""

from __future__ import annotations

import os

import numpy as np

from gsi_jax.errors import GSIError
from gsi_jax.models.config import ModelConfig

GGUF_MAGIC = b"GGUF"


def open_gguf(path: str):
  """A GGUFReader for `path`, after checking the magic and that no tensor runs past the end."""
  import gguf
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


def config_from_gguf(reader, path: str) -> ModelConfig:
  """The ModelConfig of a Llama-architecture GGUF, from its metadata."""
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise GSIError(f"{path}: GGUF architecture {arch!r} is not supported (llama only)")
  a = "llama."
  d = int(_field(reader, a + "embedding_length"))
  heads = int(_field(reader, a + "attention.head_count"))
  names = {t.name for t in reader.tensors}
  scaling = _field(reader, a + "rope.scaling.type")
  if scaling not in (None, "none"):
    raise GSIError(f"{path}: RoPE scaling {scaling!r} is not supported")
  vocab = _field(reader, a + "vocab_size")
  if vocab is None:
    vocab = len(reader.get_field("tokenizer.ggml.tokens").data)
  head_dim = int(_field(reader, a + "attention.key_length", d // heads))
  return ModelConfig(
      family="llama", vocab_size=int(vocab), d_model=d,
      n_layers=int(_field(reader, a + "block_count")), n_heads=heads,
      n_kv_heads=int(_field(reader, a + "attention.head_count_kv", heads)),
      head_dim=head_dim, d_ff=int(_field(reader, a + "feed_forward_length")),
      activation="silu", norm="rmsnorm",
      norm_eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
      gated_mlp=True, rope_theta=float(_field(reader, a + "rope.freq_base", 10000.0)),
      tied_embeddings="output.weight" not in names,
      name=str(_field(reader, "general.name", os.path.basename(path))))


def tensor_getter(reader, path: str):
  """Tensor name -> dequantised float32 numpy array."""
  import gguf
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
  return get


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
