"""Explicit weight-mapping tables: (our parameter path, source tensor, transform).

One table per family.  Sources are Hugging Face state-dict names (minus the
"transformer."/"model." prefix) or GGUF tensor names.  Every copy is shape
checked against the parameters the model itself declares.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gsi_jax.errors import GSIError
from gsi_jax.models import params as P
from gsi_jax.models.config import ModelConfig


class Entry(NamedTuple):
  path: tuple[str, ...]
  source: str
  transform: Callable[[np.ndarray], np.ndarray]


def same(w):
  return w


def linear(w):
  """torch nn.Linear stores (out, in); our kernels are (in, out)."""
  return w.T


def columns(start: int, stop: int):
  """A slice of the output axis of an (in, out) kernel or an (out,) bias."""
  return lambda w: w[..., start:stop]


def gguf_unpermute(n_heads: int):
  """Undo llama.cpp's q/k row permutation (interleaved RoPE -> HF halves)."""
  def f(w):
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))
  return f


def _site(layer, site, kind, name):
  return (P.layer_name(layer), site, kind, name)


def _norm(layer_or_none, name, bias=True):
  prefix = () if layer_or_none is None else (P.layer_name(layer_or_none),)
  keys = ("scale", "bias") if bias else ("scale",)
  return [prefix + (name, "norm", k) for k in keys]


def gpt2_table(c: ModelConfig) -> list[Entry]:
  """GPT-2 state dict -> our tree (Conv1D kernels are already (in, out))."""
  d = c.d_model
  t = [Entry((P.EMBED, P.EMBEDDING), "wte.weight", same),
       Entry(("pos_embed", "embedding"), "wpe.weight", same),
       Entry(("final_norm", "norm", "scale"), "ln_f.weight", same),
       Entry(("final_norm", "norm", "bias"), "ln_f.bias", same)]
  for i in range(c.n_layers):
    h = f"h.{i}."
    for kind, suffix in ((P.KERNEL, "weight"), (P.BIAS, "bias")):
      # GPT-2's Conv1D stores (in, out): no transpose, fused q|k|v columns.
      for j, name in enumerate("qkv"):
        t.append(Entry(_site(i, "attn_in", kind, name), h + "attn.c_attn." + suffix,
                       columns(j * d, (j + 1) * d)))
      t += [Entry(_site(i, "attn_out", kind, "o"), h + "attn.c_proj." + suffix, same),
            Entry(_site(i, "mlp_in", kind, "fc_in"), h + "mlp.c_fc." + suffix, same),
            Entry(_site(i, "mlp_out", kind, "fc_out"), h + "mlp.c_proj." + suffix, same)]
    for norm, hf in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
      t += [Entry((P.layer_name(i), norm, "norm", "scale"), h + hf + ".weight", same),
            Entry((P.layer_name(i), norm, "norm", "bias"), h + hf + ".bias", same)]
  return t


def gptj_table(c: ModelConfig) -> list[Entry]:
  """GPT-J state dict -> our tree (fc_in joins q/k/v in the attn_in site)."""
  t = [Entry((P.EMBED, P.EMBEDDING), "wte.weight", same),
       Entry(("final_norm", "norm", "scale"), "ln_f.weight", same),
       Entry(("final_norm", "norm", "bias"), "ln_f.bias", same),
       Entry((P.LM_HEAD, P.KERNEL), "lm_head.weight", linear),
       Entry((P.LM_HEAD, P.BIAS), "lm_head.bias", same)]
  for i in range(c.n_layers):
    h = f"h.{i}."
    t += [Entry(_site(i, "attn_in", P.KERNEL, n), h + f"attn.{n}_proj.weight", linear)
          for n in "qkv"]
    t += [Entry(_site(i, "attn_out", P.KERNEL, "o"), h + "attn.out_proj.weight", linear),
          Entry(_site(i, "attn_in", P.KERNEL, "fc_in"), h + "mlp.fc_in.weight", linear),
          Entry(_site(i, "attn_in", P.BIAS, "fc_in"), h + "mlp.fc_in.bias", same),
          Entry(_site(i, "mlp_out", P.KERNEL, "fc_out"), h + "mlp.fc_out.weight", linear),
          Entry(_site(i, "mlp_out", P.BIAS, "fc_out"), h + "mlp.fc_out.bias", same),
          Entry((P.layer_name(i), "attn_norm", "norm", "scale"), h + "ln_1.weight", same),
          Entry((P.layer_name(i), "attn_norm", "norm", "bias"), h + "ln_1.bias", same)]
  return t


def opt_table(c: ModelConfig) -> list[Entry]:
  """OPT state dict -> our tree (projected embeddings when word_embed_proj_dim < d)."""
  p = "decoder."
  t = [Entry((P.EMBED, P.EMBEDDING), p + "embed_tokens.weight", same),
       Entry(("pos_embed", "embedding"), p + "embed_positions.weight", same)]
  if c.embed_proj_dim:
    t += [Entry(("project_in", "kernel"), p + "project_in.weight", linear),
          Entry(("project_out", "kernel"), p + "project_out.weight", linear)]
  if c.final_norm:
    t += [Entry(("final_norm", "norm", "scale"), p + "final_layer_norm.weight", same),
          Entry(("final_norm", "norm", "bias"), p + "final_layer_norm.bias", same)]
  for i in range(c.n_layers):
    h = f"{p}layers.{i}."
    maps = [("attn_in", n, f"self_attn.{n}_proj") for n in "qkv"]
    maps += [("attn_out", "o", "self_attn.out_proj"), ("mlp_in", "fc_in", "fc1"),
             ("mlp_out", "fc_out", "fc2")]
    for site, name, hf in maps:
      t.append(Entry(_site(i, site, P.KERNEL, name), h + hf + ".weight", linear))
      if c.attn_bias:
        t.append(Entry(_site(i, site, P.BIAS, name), h + hf + ".bias", same))
    for norm, hf in (("attn_norm", "self_attn_layer_norm"), ("mlp_norm", "final_layer_norm")):
      t += [Entry((P.layer_name(i), norm, "norm", "scale"), h + hf + ".weight", same),
            Entry((P.layer_name(i), norm, "norm", "bias"), h + hf + ".bias", same)]
  return t


def llama_table(c: ModelConfig) -> list[Entry]:
  """Llama state dict -> our tree."""
  t = [Entry((P.EMBED, P.EMBEDDING), "embed_tokens.weight", same),
       Entry(("final_norm", "norm", "scale"), "norm.weight", same)]
  if not c.tied_embeddings:
    t.append(Entry((P.LM_HEAD, P.KERNEL), "lm_head.weight", linear))
  for i in range(c.n_layers):
    h = f"layers.{i}."
    maps = [("attn_in", n, f"self_attn.{n}_proj") for n in "qkv"]
    maps += [("attn_out", "o", "self_attn.o_proj"), ("mlp_in", "gate", "mlp.gate_proj"),
             ("mlp_in", "up", "mlp.up_proj"), ("mlp_out", "down", "mlp.down_proj")]
    for site, name, hf in maps:
      t.append(Entry(_site(i, site, P.KERNEL, name), h + hf + ".weight", linear))
      if c.mlp_bias and site.startswith("mlp"):
        t.append(Entry(_site(i, site, P.BIAS, name), h + hf + ".bias", same))
    t += [Entry((P.layer_name(i), "attn_norm", "norm", "scale"), h + "input_layernorm.weight", same),
          Entry((P.layer_name(i), "mlp_norm", "norm", "scale"),
                h + "post_attention_layernorm.weight", same)]
  return t


def gguf_llama_table(c: ModelConfig) -> list[Entry]:
  """llama.cpp GGUF tensor names -> our tree (q/k rows un-permuted to the HF layout)."""
  t = [Entry((P.EMBED, P.EMBEDDING), "token_embd.weight", same),
       Entry(("final_norm", "norm", "scale"), "output_norm.weight", same)]
  if not c.tied_embeddings:
    t.append(Entry((P.LM_HEAD, P.KERNEL), "output.weight", linear))
  for i in range(c.n_layers):
    b = f"blk.{i}."
    q_perm, k_perm = gguf_unpermute(c.n_heads), gguf_unpermute(c.n_kv_heads)
    t += [Entry(_site(i, "attn_in", P.KERNEL, "q"), b + "attn_q.weight", lambda w, p=q_perm: p(w).T),
          Entry(_site(i, "attn_in", P.KERNEL, "k"), b + "attn_k.weight", lambda w, p=k_perm: p(w).T),
          Entry(_site(i, "attn_in", P.KERNEL, "v"), b + "attn_v.weight", linear),
          Entry(_site(i, "attn_out", P.KERNEL, "o"), b + "attn_output.weight", linear),
          Entry(_site(i, "mlp_in", P.KERNEL, "gate"), b + "ffn_gate.weight", linear),
          Entry(_site(i, "mlp_in", P.KERNEL, "up"), b + "ffn_up.weight", linear),
          Entry(_site(i, "mlp_out", P.KERNEL, "down"), b + "ffn_down.weight", linear),
          Entry((P.layer_name(i), "attn_norm", "norm", "scale"), b + "attn_norm.weight", same),
          Entry((P.layer_name(i), "mlp_norm", "norm", "scale"), b + "ffn_norm.weight", same)]
  return t


HF_TABLES = {"gpt2": gpt2_table, "gptj": gptj_table, "opt": opt_table, "llama": llama_table}


def _refuse_non_finite(origin: str, name: str, value: np.ndarray, dtype) -> None:
  bad = int(np.size(value) - np.isfinite(np.asarray(value, np.float32)).sum())
  if bad:
    raise GSIError(f"{origin}: tensor {name} holds {bad} NaN or infinite values; the "
                   "checkpoint is damaged, download or convert it again")
  raise GSIError(f"{origin}: tensor {name} overflows {jnp.dtype(dtype).name}; load the model "
                 "in float32 or bfloat16")


def fill_params(table: Iterable[Entry], get: Callable[[str], np.ndarray], shapes, dtype, origin: str):
  """Build the parameter tree from `table`, checking every shape and dtype, and that
  every value is finite: a damaged or quantized checkpoint never runs.

  `shapes` is the tree of ShapeDtypeStructs the model declares; every leaf
  must be filled exactly once.  Each tensor becomes a jax array as soon as it
  is converted, so the host never holds a second full copy of the model.
  """
  flat = {tuple(k.key for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]}
  out = {}
  for entry in table:
    if entry.path not in flat:
      raise GSIError(f"{origin}: mapping names {'/'.join(entry.path)}, which the model lacks")
    value = np.asarray(entry.transform(get(entry.source)))
    if not jnp.issubdtype(value.dtype, jnp.floating):
      raise GSIError(f"{origin}: tensor {entry.source} is stored as {value.dtype.name}: "
                     "quantized or integer weights are not supported; load the float "
                     "checkpoint (or a GGUF file)")
    want = flat[entry.path].shape
    if value.shape != want:
      raise GSIError(f"{origin}: {entry.source} has shape {value.shape} after conversion, "
                     f"expected {want} for {'/'.join(entry.path)}")
    out[entry.path] = jnp.asarray(value, dtype)
    if not bool(jnp.isfinite(out[entry.path]).all()):
      _refuse_non_finite(origin, entry.source, value, dtype)
  missing = sorted("/".join(p) for p in flat if p not in out)
  if missing:
    raise GSIError(f"{origin}: no source tensor for {missing[:5]}")
  tree = {}
  for path, value in out.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree
