"""Explicit weight-mapping tables: (our parameter path, source tensor, transform).

One table per family.  Sources are Hugging Face state-dict names (minus the
"transformer."/"model." prefix) or GGUF tensor names.  Every copy is shape
checked against the parameters the model itself declares.
"""

from __future__ import annotations

import re
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


class columns(NamedTuple):
  """A slice of the output axis of an (in, out) kernel or an (out,) bias."""
  start: int
  stop: int

  def __call__(self, w):
    return w[..., self.start:self.stop]


class TensorSource(NamedTuple):
  """A checkpoint's tensors: get(name) reads one whole; get_slice(name, index), where the
  format allows, reads only `index` of it; names lists every tensor it holds."""
  get: Callable[[str], np.ndarray]
  names: frozenset
  get_slice: Callable[[str, tuple], np.ndarray] | None = None


def source_index(transform, index: tuple):
  """(index into the stored tensor, what makes that part the target's part) for a target
  `index`, or None where the transform needs the whole tensor (GGUF's row permutation)."""
  if transform is same:
    return index, same
  if transform is linear:  # stored (out, in): the target's columns are the stored rows
    return index[::-1], linear
  if isinstance(transform, columns):
    *lead, last = index
    start = transform.start + (last.start or 0)
    stop = transform.start + (transform.stop - transform.start if last.stop is None
                              else last.stop)
    return (*lead, slice(start, stop)), same
  return None


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


# Buffers that HF checkpoints of some versions carry and no model reads: GPT-2/GPT-J's
# causal masks and Llama's rotary frequencies (recomputed from the config).
HARMLESS_UNUSED = re.compile(r"(^|\.)(attn\.(masked_)?bias|rotary_emb\.inv_freq)$")
TIED_HEAD = "lm_head.weight"


def check_all_used(table: Iterable[Entry], source: TensorSource, config: ModelConfig,
                   origin: str) -> None:
  """Refuse a checkpoint that holds weights this model would never read: more layers
  than the config says, a head the config calls tied, another architecture's tensors.
  Each means the config and the weights disagree, and the model would run without them."""
  table = list(table)
  used = {e.source for e in table}
  unused = sorted(n for n in source.names if n not in used and not HARMLESS_UNUSED.search(n))
  if unused == [TIED_HEAD] and config.tied_embeddings:
    embed = next(e.source for e in table if e.path == (P.EMBED, P.EMBEDDING))
    if np.array_equal(np.asarray(source.get(TIED_HEAD)), np.asarray(source.get(embed))):
      return  # a tied head saved twice, as some exporters do
    raise GSIError(f"{origin}: the config ties the LM head to the embedding, but the "
                   f"checkpoint's {TIED_HEAD} differs from {embed}; fix tie_word_embeddings")
  if unused:
    shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
    raise GSIError(f"{origin}: the checkpoint holds {len(unused)} tensor(s) that a "
                   f"{config.family} model with this config never reads ({shown}); the "
                   "config does not describe these weights (n_layers, tied embeddings, "
                   "model_type?)")


def fill_params(table: Iterable[Entry], source: TensorSource, shapes, dtype, origin: str,
                placement=None) -> tuple[dict, int]:
  """Build the parameter tree from `table`, checking every shape and dtype, and that
  every value is finite: a damaged or quantized checkpoint never runs.  Returns the
  tree and the bytes read from the checkpoint.

  `shapes` is the tree of ShapeDtypeStructs the model declares; every leaf
  must be filled exactly once.  Each tensor becomes a jax array as soon as it
  is converted, so the host never holds a second full copy of the model.
  `placement` (a tree of shardings like `shapes`, or None) places each leaf; where the
  format allows (safetensors) a leaf split across devices is read part by part, so a
  process reads only the parts its own devices hold.
  """
  flat = {tuple(k.key for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]}
  places = ({tuple(k.key for k in path): s for path, s in jax.tree_util.tree_flatten_with_path(
      placement)[0]} if placement is not None else {})
  read = [0]

  def convert(entry, value, want):
    value = np.asarray(value)
    read[0] += value.nbytes
    if not jnp.issubdtype(value.dtype, jnp.floating):
      raise GSIError(f"{origin}: tensor {entry.source} is stored as {value.dtype.name}: "
                     "quantized or integer weights are not supported; load the float "
                     "checkpoint (or a GGUF file)")
    if value.shape != want:
      raise GSIError(f"{origin}: {entry.source} has shape {value.shape} after conversion, "
                     f"expected {want} for {'/'.join(entry.path)}")
    with np.errstate(over="ignore"):  # an overflow is refused by name just below
      out = np.asarray(value, dtype)
    if not np.isfinite(out).all():
      _refuse_non_finite(origin, entry.source, value, dtype)
    return out

  def part(entry, index):
    """The target's `index` of one entry, read as a slice of the stored tensor."""
    stored_index, finish = source_index(entry.transform, index)
    want = tuple(len(range(*s.indices(n))) for s, n in zip(index, flat[entry.path].shape))
    return convert(entry, finish(source.get_slice(entry.source, stored_index)), want)

  def sliceable(entry):
    return source.get_slice is not None and source_index(
        entry.transform, (slice(None),) * len(flat[entry.path].shape)) is not None

  out = {}
  for entry in table:
    if entry.path not in flat:
      raise GSIError(f"{origin}: mapping names {'/'.join(entry.path)}, which the model lacks")
    place = places.get(entry.path)
    want = flat[entry.path].shape
    if place is None:
      out[entry.path] = jnp.asarray(convert(entry, entry.transform(source.get(entry.source)),
                                            want))
    elif place.is_fully_replicated or not sliceable(entry):
      # Read whole once; each device takes its part of this host's copy (a device_put onto
      # the devices of several processes would hold transient copies of it).
      value = convert(entry, entry.transform(source.get(entry.source)), want)
      out[entry.path] = jax.make_array_from_callback(want, place, lambda index, v=value: v[index])
    else:  # each of this process's devices reads and holds only its part
      out[entry.path] = jax.make_array_from_callback(
          want, place, lambda index, e=entry: part(e, index))
  missing = sorted("/".join(p) for p in flat if p not in out)
  if missing:
    raise GSIError(f"{origin}: no source tensor for {missing[:5]}")
  tree = {}
  for path, value in out.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree, read[0]
