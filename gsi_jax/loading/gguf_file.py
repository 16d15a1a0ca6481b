"""GGUF files (Llama architecture): config, dequantized weights, tokenizer."""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np

from gsi_jax.errors import GSIError
from gsi_jax.loading.mapping import TensorSource
from gsi_jax.models.config import ModelConfig

GGUF_MAGIC = b"GGUF"
# Bytes of each GGUF scalar value type (llama.cpp's gguf.h); 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 8  # GGML_MAX_DIMS is 4


class _Header:
  """A bounds-checked walk over a GGUF header: every count it declares is checked against
  the bytes left in the file before anything is read or allocated for it."""

  def __init__(self, data, path: str):
    self.data, self.path, self.at, self.order = data, path, 0, "<"

  def refuse(self, what: str):
    raise GSIError(f"{self.path}: GGUF header declares {what}, more than the file's "
                   f"{len(self.data)} bytes can hold; the file is truncated, damaged or "
                   "crafted")

  def take(self, fmt: str) -> int:
    size = struct.calcsize(fmt)
    if self.at + size > len(self.data):
      self.refuse(f"a field at byte {self.at} past its end")
    value = struct.unpack_from(self.order + fmt, self.data, self.at)[0]
    self.at += size
    return value

  def count(self, fmt: str, min_item: int, what: str) -> int:
    n = self.take(fmt)
    if n * min_item > len(self.data) - self.at:
      self.refuse(f"{n} {what}")
    return n

  def string(self) -> None:
    length = self.count("Q", 1, "bytes of a string")
    self.at += length

  def value(self, kind: int) -> None:
    if kind in _SCALAR_BYTES:
      self.at += _SCALAR_BYTES[kind]
    elif kind == _STRING:
      self.string()
    elif kind == _ARRAY:
      item = self.take("I")
      least = _SCALAR_BYTES.get(item, 8 if item == _STRING else 12)
      for _ in range(self.count("Q", least, "array items")):
        self.value(item)
    else:
      raise GSIError(f"{self.path}: GGUF value type {kind} at byte {self.at} is unknown; "
                     "the file is damaged")
    if self.at > len(self.data):
      self.refuse(f"a value at byte {self.at} past its end")

  def walk(self) -> None:
    self.at = 4
    version = self.take("I")
    if version > 0xFFFF:  # written big-endian
      self.order = ">"
    n_tensors = self.count("Q", 8 + 4 + 8 + 4 + 8, "tensors")
    for _ in range(self.count("Q", 8 + 4 + 1, "metadata fields")):
      self.string()
      self.value(self.take("I"))
    for _ in range(n_tensors):
      self.string()
      dims = self.take("I")
      if dims > _MAX_DIMS:
        self.refuse(f"a tensor of {dims} dimensions")
      self.at += 8 * dims + 4 + 8
    if self.at > len(self.data):
      self.refuse("tensor descriptions past its end")


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
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
      _Header(data, path).walk()  # before gguf's reader allocates for what it declares
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
                                         gguf_file=os.path.basename(path),
                                         trust_remote_code=False)
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
