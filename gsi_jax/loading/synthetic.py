"""Random-weight Hugging Face checkpoints of the paper's published shapes.

No 6B checkpoint can be downloaded here; memory, time and bytes at that scale
do not depend on the weights' values, so these stand in for them.  Names and
shapes come from transformers itself (the model built on the meta device), and
the files are what `save_pretrained` writes: sharded bf16 safetensors with a
`model.safetensors.index.json`.  Quality measured on them means nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time

from gsi_jax.errors import GSIError

# The published configs (EleutherAI/gpt-j-6b, facebook/opt-6.7b, facebook/opt-66b,
# openai-community/gpt2-xl; OPT-175B from Table 1 of the OPT paper, its weights being gated).
SHAPES = {
    "gptj-6b": ("GPTJConfig", dict(vocab_size=50400, n_positions=2048, n_embd=4096, n_layer=28,
                                   n_head=16, rotary_dim=64)),
    "opt-6.7b": ("OPTConfig", dict(vocab_size=50272, hidden_size=4096, ffn_dim=16384,
                                   num_hidden_layers=32, num_attention_heads=32,
                                   word_embed_proj_dim=4096, max_position_embeddings=2048,
                                   do_layer_norm_before=True)),
    "opt-66b": ("OPTConfig", dict(vocab_size=50272, hidden_size=9216, ffn_dim=36864,
                                  num_hidden_layers=64, num_attention_heads=72,
                                  word_embed_proj_dim=9216, max_position_embeddings=2048,
                                  do_layer_norm_before=True)),
    "opt-175b": ("OPTConfig", dict(vocab_size=50272, hidden_size=12288, ffn_dim=49152,
                                   num_hidden_layers=96, num_attention_heads=96,
                                   word_embed_proj_dim=12288, max_position_embeddings=2048,
                                   do_layer_norm_before=True)),
    "gpt2-1.5b": ("GPT2Config", dict(vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48,
                                     n_head=25)),
    # GPT-J's architecture at test size: dry runs of the scale benchmark (gpu_check.sh).
    "gptj-tiny": ("GPTJConfig", dict(vocab_size=512, n_positions=256, n_embd=128, n_layer=2,
                                     n_head=4, rotary_dim=16, bos_token_id=0, eos_token_id=0)),
}
INDEX_FILE = "model.safetensors.index.json"


def hf_config(shape: str, **overrides):
  """The transformers config of a published shape (overrides: e.g. n_layer for tests)."""
  import transformers
  if shape not in SHAPES:
    raise GSIError(f"unknown shape {shape!r}; use one of {', '.join(SHAPES)}")
  cls, kwargs = SHAPES[shape]
  return getattr(transformers, cls)(**{**kwargs, **overrides})


def _parameter_shapes(config) -> list[tuple[str, tuple[int, ...]]]:
  """(name, shape) of every parameter, tied ones once, without allocating weights."""
  import torch
  from transformers import AutoModelForCausalLM
  with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config)
  return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def write_random_checkpoint(config, folder: str, shard_bytes: int = 2 << 30, seed: int = 0,
                            std: float = 0.02, dtype: str = "bfloat16") -> dict:
  """Write `config` with N(0, std) matrices, unit norm scales and zero biases.

  Shards are filled and written one at a time, so memory stays near one shard.
  Returns {"files", "bytes", "parameters", "seconds"}.
  """
  import torch
  from safetensors.torch import save_file
  torch_dtype = getattr(torch, dtype)
  os.makedirs(folder, exist_ok=True)
  generator = torch.Generator().manual_seed(seed)
  shapes = _parameter_shapes(config)
  shards, current, size = [], [], 0
  for name, shape in shapes:
    nbytes = torch.Size(shape).numel() * torch_dtype.itemsize
    if current and size + nbytes > shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append((name, shape))
    size += nbytes
  shards.append(current)
  t0, total, weight_map = time.time(), 0, {}
  for i, shard in enumerate(shards):
    filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    tensors = {}
    for name, shape in shard:
      if len(shape) >= 2:
        t = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(std)
      elif name.endswith("weight"):  # a norm's scale
        t = torch.ones(shape)
      else:
        t = torch.zeros(shape)
      tensors[name] = t.to(torch_dtype)
      weight_map[name] = filename
      total += tensors[name].numel() * torch_dtype.itemsize
    partial = os.path.join(folder, filename + ".partial")
    save_file(tensors, partial, metadata={"format": "pt"})
    os.replace(partial, os.path.join(folder, filename))
    logging.info("checkpoint shard %d/%d written (%.1f GB so far, %.0f s)", i + 1, len(shards),
                 total / 1e9, time.time() - t0)
  config.save_pretrained(folder)
  with open(os.path.join(folder, INDEX_FILE), "w", encoding="utf-8") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
  return {"files": len(shards), "bytes": total, "seconds": time.time() - t0,
          "parameters": sum(torch.Size(s).numel() for _, s in shapes)}


def random_model(shape: str, dtype="bfloat16", n_layers: int | None = None, seed: int = 0,
                 std: float = 0.02, **overrides):
  """A published shape with N(0, std) matrices, unit norm scales and zero biases, generated
  where JAX computes (a GPU's own memory) with nothing written to disk: a lent machine
  that cannot hold or write a 12 GB checkpoint still runs the shape.  No tokenizer.
  overrides: Hugging Face config fields that change the shape (n_layer=4, say)."""
  import jax
  import jax.numpy as jnp
  from gsi_jax.loading.hf_config import config_from_hf
  from gsi_jax.loading.load import first_layers, param_shapes
  from gsi_jax.models.model import Model
  config = first_layers(config_from_hf(hf_config(shape, **overrides).to_dict(), name=shape),
                        n_layers)
  shapes = param_shapes(config, dtype)
  paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)

  def fill(i, path, leaf):
    name = getattr(path[-1], "key", "")
    if len(leaf.shape) >= 2:
      key = jax.random.fold_in(jax.random.key(seed), i)
      return (std * jax.random.normal(key, leaf.shape, jnp.float32)).astype(leaf.dtype)
    return (jnp.ones if name == "scale" else jnp.zeros)(leaf.shape, leaf.dtype)
  leaves = [fill(i, path, leaf) for i, (path, leaf) in enumerate(paths)]
  return Model(config=config, params=jax.tree.unflatten(treedef, leaves), dtype=jnp.dtype(dtype),
               source=f"random {shape} weights (seed {seed}), generated in memory")


def is_complete(folder: str) -> bool:
  """Written to the end: the index (saved last) and every shard it names exist."""
  index = os.path.join(folder, INDEX_FILE)
  if not os.path.isfile(index):
    return False
  with open(index, encoding="utf-8") as f:
    files = set(json.load(f)["weight_map"].values())
  return all(os.path.isfile(os.path.join(folder, name)) for name in files)
