"""The parameter layout: the one module that spells parameter keys.

    embed/embedding, pos_embed/embedding, final_norm, lm_head/{kernel, bias},
    layer_{i}/{attn_norm, mlp_norm}/norm/{scale, bias},
    layer_{i}/{site}/kernel/{map}: W (d, O),  layer_{i}/{site}/bias/{map}: (O,).

Sites: attn_in (q, k, v; GPT-J's fc_in too), attn_out (o), mlp_in (fc_in, or
gate and up), mlp_out (fc_out or down).  GSI adds to a site (or to the LM head)
  V: the basis V_k (d, k);  M/{map}: V_kᵀ W (k, O);
a decode adds  V_T: V_kᵀ (k, d), made once before its loop and never stored
(`with_transposed_bases`); and beyond the paper  sketch, sketch_M (output-aware gate),  ladder (nested
ranks),  eps (a site's own gate threshold, learned: `gsi_jax.peers.allocation`),
residual_threshold (subspace plus sparse residual: y = g M + r_S W_S, no gate).
Peers add  threshold (magnitude sparsity),  rotation (d, d) (LaRoSA: the
site's input is rotated into its PCA basis, and its kernels are Qᵀ W), and
factor_in/{map} (d, r), factor_out/{map} (r, O) (weight SVD as two thin maps; with a
threshold, R-Sparse's low-rank path for the dropped inputs), and at a gated MLP's
mlp_in  cats_threshold (CATS: channels with |act(x W_gate)| below it are dropped)
and  cats_up_t (d_ff, d) (W_up transposed, whose kept rows CATS' fast path reads).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from gsi_jax.errors import GSIError

SITES = ("attn_in", "attn_out", "mlp_in", "mlp_out")
KERNEL, BIAS = "kernel", "bias"
V, M = "V", "M"
V_T = "V_T"  # V_kᵀ (k, d): made by a decode (`with_transposed_bases`), never stored
SKETCH, SKETCH_M, LADDER = "sketch", "sketch_M", "ladder"
EPS = "eps"
RESIDUAL_THRESHOLD = "residual_threshold"
THRESHOLD, ROTATION = "threshold", "rotation"
FACTOR_IN, FACTOR_OUT = "factor_in", "factor_out"
CATS_THRESHOLD, CATS_UP_T = "cats_threshold", "cats_up_t"
GSI_KEYS = (V, M, SKETCH, SKETCH_M, LADDER, EPS, RESIDUAL_THRESHOLD)
# Not split along outputs.
REPLICATED_KEYS = (V, SKETCH, SKETCH_M, LADDER, EPS, RESIDUAL_THRESHOLD, THRESHOLD, ROTATION,
                   FACTOR_IN, CATS_THRESHOLD)
# Stored (O, d): split along their first axis, as the map they transpose is split.
TRANSPOSED_KEYS = (CATS_UP_T,)
# Per-site scalars and vectors that a step reads beside the kernels (counted as "other").
SITE_KNOBS = (BIAS, THRESHOLD, RESIDUAL_THRESHOLD, CATS_THRESHOLD)
LM_HEAD, EMBED, EMBEDDING = "lm_head", "embed", "embedding"
HEAD_MAP = "logits"  # the LM head's one map, under M/
SITE_INPUTS, HEAD_INPUTS = "site_inputs", "head_inputs"
_LAYER = "layer_"


def check_tree(params, what: str = "params"):
  """A model's parameter tree (model.params, or a tree a transform returned), else one
  GSIError naming the argument."""
  if not (isinstance(params, dict) and EMBED in params and layers(params)):
    raise GSIError(f"{what} must be a model's parameter tree (model.params, or what "
                   f"apply_gsi returns), got {type(params).__name__}")
  return params


def check_per_site(params, values, what: str) -> dict:
  """{layer: {site: value}} naming only layers and sites the tree has."""
  sites = site_kernels(check_tree(params))
  if not isinstance(values, dict) or not all(isinstance(v, dict) for v in values.values()):
    raise GSIError(f"{what} must map layers to {{site: value}}, got {type(values).__name__}")
  for layer, per_site_values in values.items():
    if layer not in sites:
      raise GSIError(f"{what} names {layer!r}, not a layer of this model (it has "
                     f"{len(sites)}: {layer_name(0)}..{layer_name(len(sites) - 1)})")
    for site in per_site_values:
      if site not in sites[layer]:
        raise GSIError(f"{what} names {layer}/{site!r}, not a site of this model "
                       f"({', '.join(sites[layer])})")
  return values


def layer_name(i: int) -> str:
  return f"{_LAYER}{i}"


def layer_index(name: str) -> int:
  return int(name[len(_LAYER):])


def is_layer(name: str) -> bool:
  return name.startswith(_LAYER) and name[len(_LAYER):].isdigit()


def layers(tree) -> list[str]:
  """The layer keys of a tree, in depth order."""
  return sorted((name for name in tree if is_layer(name)), key=layer_index)


def site_kernels(params) -> dict[str, dict[str, dict[str, Any]]]:
  """{layer: {site: {map: W_DO}}} for every linear-map site, in depth order."""
  out = {}
  for layer in layers(params):
    for site, node in params[layer].items():
      if isinstance(node, dict) and isinstance(node.get(KERNEL), dict):
        out.setdefault(layer, {})[site] = node[KERNEL]
  return out


def site_widths(params) -> dict[str, dict[str, int]]:
  """{layer: {site: d}}: the width of each site's input."""
  return {layer: {site: next(iter(kernels.values())).shape[0]
                  for site, kernels in sites.items()}
          for layer, sites in site_kernels(params).items()}


def site_outputs(params) -> dict[str, dict[str, int]]:
  """{layer: {site: ΣO}}: the outputs of all of a site's maps."""
  return {layer: {site: sum(W.shape[1] for W in kernels.values())
                  for site, kernels in sites.items()}
          for layer, sites in site_kernels(params).items()}


def widest_site(params) -> int:
  return max(d for sites in site_widths(params).values() for d in sites.values())


def site_shapes(params) -> list[tuple[str, str, int, int]]:
  """(layer, site, d, ΣO) for every site."""
  outs = site_outputs(params)
  return [(layer, site, d, outs[layer][site])
          for layer, sites in site_widths(params).items() for site, d in sites.items()]


def head(params) -> dict:
  """The LM head's own parameters ({} for a tied head without GSI)."""
  return params.get(LM_HEAD, {})


def head_kernel(params):
  """W_DV of the LM head: its own kernel, or the transposed embedding table if tied."""
  own = head(params)
  return own[KERNEL] if KERNEL in own else params[EMBED][EMBEDDING].T


HEAD_COLUMNS = 64  # a GSI head's M has its columns padded to a multiple of this


def head_m_columns(vocab: int) -> int:
  """The stored columns of a GSI head's M: the vocabulary padded to HEAD_COLUMNS (its padding
  is zero, and the outputs past the vocabulary are dropped)."""
  return -(-vocab // HEAD_COLUMNS) * HEAD_COLUMNS


def head_shape(params) -> tuple[int, int]:
  """(d, vocab) of the LM head; reads only shapes, so abstract trees work too."""
  own = head(params)
  if KERNEL in own:
    return tuple(own[KERNEL].shape)
  vocab, d = params[EMBED][EMBEDDING].shape
  return d, vocab


def has_gsi(node) -> bool:
  return V in node


def with_transposed_bases(params):
  """params with V_T = V_kᵀ (k, d) beside every V_k (sites and LM head), for a decode to
  make once, before its loop.  On a GPU, g = x V_k over (k, d) rows is one row-reduction
  kernel; over V_k's own (d, k) columns XLA's GPU compiler (which strength-reduces a
  one-token dot this small into a multiply and a reduce) launches a multiply that writes
  x·V_k and a column reduce on two blocks."""
  def walk(node):
    if not isinstance(node, dict):
      return node
    node = {key: walk(value) for key, value in node.items()}
    return {**node, V_T: node[V].T} if V in node else node
  return walk(params)


def with_site(params, layer: str, site: str, extra: dict):
  """A new tree whose site holds `extra` beside what it had (others shared)."""
  return {**params, layer: {**params[layer], site: {**params[layer][site], **extra}}}


def per_site(params, value) -> dict:
  """{layer: {site: value}} for every site: one knob everywhere (a uniform allocation)."""
  return {layer: {site: value for site in sites} for layer, sites in site_kernels(params).items()}


def any_site_holds(params, key: str) -> bool:
  """Whether any site holds `key` beside its kernels (a per-site ε, a residual threshold,
  as `with_site_values` writes them): the layers' site dicts are read, not their arrays."""
  return any(isinstance(node, dict) and key in node
             for layer in layers(params) for node in params[layer].values())


def with_site_values(params, key: str, values: dict):
  """A new tree with {layer: {site: value}} written under `key` at each site (a
  sparsity threshold, a learned ε)."""
  out = params
  for layer, sites in values.items():
    for site, v in sites.items():
      out = with_site(out, layer, site, {key: jnp.asarray(v, jnp.float32)})
  return out


def dense_params(params):
  """The dense tree back: every GSI key dropped, the LM head's included."""
  out = dict(check_tree(params))
  for layer, sites in site_kernels(params).items():
    out[layer] = {**out[layer], **{site: {k: v for k, v in out[layer][site].items()
                                          if k not in GSI_KEYS} for site in sites}}
  own = {k: v for k, v in out.pop(LM_HEAD, {}).items() if k not in GSI_KEYS}
  if own:  # a tied head has no parameters of its own
    out[LM_HEAD] = own
  return out


def unwrap_sown(tree, name: str = "x"):
  """A sown collection with each {name: (value,)} replaced by value."""
  if name in tree:
    return tree[name][0]
  return {key: unwrap_sown(v, name) for key, v in tree.items()}
