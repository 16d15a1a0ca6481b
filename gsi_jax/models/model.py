"""A loaded model: config, parameters, tokenizer, and jitted entry points."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsi_jax.errors import GSIError, NonFiniteResult, flag, whole
from gsi_jax.models import params as P
from gsi_jax.models.config import ModelConfig
from gsi_jax.models.decoder import Decoder, init_cache
from gsi_jax.ops import Gate


def _gate_counts(gate_stats, active_B) -> dict:
  """{layer: {site: (fast tokens, tokens, V columns read, M rows read)}} from the sown
  fast masks and ranks, summed over the tokens of the rows still decoding (active_B: a
  finished row repeats its last token, which is no token of its decode; a rank ladder's
  token reads its rung of M)."""
  out = {}
  for layer, sites in gate_stats.items():
    for site, val in sites.items():
      fast, rank = val["fast"][0].astype(jnp.float32), val["rank"][0].astype(jnp.float32)
      w = jnp.broadcast_to(active_B.astype(jnp.float32).reshape(
          (-1,) + (1,) * (fast.ndim - 1)), fast.shape)
      out.setdefault(layer, {})[site] = jnp.stack(
          [jnp.sum(fast * w), jnp.sum(w), jnp.sum(rank * w), jnp.sum(rank * fast * w)])
  return out


@functools.partial(jax.jit, static_argnames=("module", "collections"))
def _forward(module, params, ids_BT, gate, collections=()):
  (logits, _), state = module.apply({"params": params}, ids_BT, gate=gate,
                                    mutable=list(collections))
  return logits, state


# The token a decode draws from logits holding NaN or +inf: never a token id.
NONFINITE = -1

# Prompts are padded on the right to a multiple of this many tokens, so that prompts of
# nearby lengths share one compiled decode program.
PROMPT_BUCKET = 16


@functools.partial(jax.jit, static_argnames=("module", "max_new_tokens", "stats"))
def _generate(module, params, ids_BL, prompt_len, gate, max_new_tokens, eos_ids, expected_BN,
              stats=False):
  """Greedy tokens (B, max_new_tokens), how many steps ran, and the decode steps' counts
  ({} unless `stats`: the gate statistics are sown, counted and summed at every site only
  when a caller asks, so a timed decode computes none of them).  A token drawn from logits
  holding NaN or +inf is NONFINITE, and ends its row.

  ids_BL holds the prompt in its first prompt_len columns; the rest is padding, which
  no real position attends to (attention is causal by position) and which the decode
  steps overwrite in the cache before they attend to it.  The loop ends early once
  every row has produced one of eos_ids (empty or negative: never), or a token other
  than expected_BN's at its step (negative: any token); a finished row repeats its
  last token.
  """
  B, L = ids_BL.shape
  params = P.with_transposed_bases(params)  # once, before the loop
  dtype = jax.tree.leaves(params["embed"])[0].dtype
  cache = init_cache(module.config, B, L + max_new_tokens, dtype)

  def step(ids, start, cache, last, active_B):
    if stats:
      (logits, cache), state = module.apply({"params": params}, ids, start, cache, gate,
                                            mutable=["gate_stats"])
      counts = _gate_counts(state.get("gate_stats", {}), active_B)
    else:  # a collection that is not mutable is never sown
      (logits, cache), counts = module.apply({"params": params}, ids, start, cache, gate), {}
    logits_BV = jax.lax.dynamic_index_in_dim(logits, last, axis=1, keepdims=False)
    tok_B = jnp.argmax(logits_BV, -1).astype(ids_BL.dtype)
    # argmax takes NaN (and +inf) for the largest, so the logit drawn is finite exactly
    # when its row holds no NaN or +inf: one element a row read back, no second pass over
    # the vocabulary.  A row whose drawn logit is not finite draws NONFINITE, ending it.
    drawn_B = jnp.take_along_axis(logits_BV, tok_B[:, None].astype(jnp.int32), -1)[:, 0]
    return jnp.where(jnp.isfinite(drawn_B), tok_B, NONFINITE), cache, counts

  def finished(tok, i):
    expected = jax.lax.dynamic_index_in_dim(expected_BN, i, axis=1, keepdims=False)
    return (jnp.any(tok[:, None] == eos_ids[None, :], -1) | (tok == NONFINITE)
            | ((expected >= 0) & (tok != expected)))

  tok, cache, counts = step(ids_BL, 0, cache, prompt_len - 1, jnp.ones((B,), bool))
  out = jnp.zeros((B, max_new_tokens), ids_BL.dtype).at[:, 0].set(tok)
  zero_counts = jax.tree.map(jnp.zeros_like, counts)

  def cond(carry):
    _, _, i, done, _, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    tok, cache, i, done, out, total = carry
    nxt, cache, counts = step(tok[:, None], prompt_len + i - 1, cache, 0, ~done)
    nxt = jnp.where(done, tok, nxt)
    out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
    return (nxt, cache, i + 1, done | finished(nxt, i), out,
            jax.tree.map(jnp.add, total, counts))

  _, _, steps, _, out, decode_counts = jax.lax.while_loop(
      cond, body, (tok, cache, jnp.int32(1), finished(tok, 0), out, zero_counts))
  return out, steps, decode_counts


def concrete_thresholds(gate: Gate) -> list[float] | None:
  """The gate's ε (and its head's) as numbers, or None where they are traced (a sweep's)."""
  try:
    return [float(gate.eps)] + ([] if gate.head_eps is None else [float(gate.head_eps)])
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def decode_gate(params, gate: Gate | None, keep_stats: bool = False) -> Gate | None:
  """The gate a decode compiles with, decided once per model from concrete thresholds,
  not at each site: a plain gate whose every threshold is <= 0 takes no fast path, so the
  decode is dense's program (mode "dense": W alone, no branch, no V_k), unless keep_stats
  (the gate statistics a dense program does not sow); one whose thresholds are all > 0
  skips every site's ε <= 0 branch (`Gate.eps_positive`).  Traced thresholds, a tree's
  per-site thresholds (a learned allocation) or a sparse residual keep the sites' own."""
  if gate is None or gate.mode != "gated":
    return gate
  eps = concrete_thresholds(gate)
  if eps is None:
    return gate
  if P.any_site_holds(params, P.EPS) or P.any_site_holds(params, P.RESIDUAL_THRESHOLD):
    return gate
  if all(e <= 0 for e in eps) and not keep_stats:
    return gate.replace(mode="dense")
  if all(e > 0 for e in eps):
    return gate.replace(eps_positive=True)
  return gate


def device_memory_bytes() -> int:
  """Memory of this process's first device: an accelerator's own limit, else the host's RAM.
  (jax.devices()[0] may belong to another process, whose memory no process can ask.)"""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_gate(gate, params=None) -> None:
  """A Gate or None; with `params`, a gate that would take a GSI path (static, or a
  threshold above 0) needs bases to take it: over a tree that holds none it would run as
  dense, silently."""
  if gate is not None and not isinstance(gate, Gate):
    raise GSIError(f"gate must be a gsi_jax.ops.Gate (make_gate(...)) or None, "
                   f"got {type(gate).__name__}")
  if params is None or gate is None or gate.mode not in ("gated", "static"):
    return
  thresholds = concrete_thresholds(gate)
  if thresholds is None or gate.mode == "gated" and all(e <= 0 for e in thresholds):
    return
  if not (P.any_site_holds(params, P.V) or P.V in params.get(P.LM_HEAD, {})):
    raise GSIError(f"a {gate.mode} GSI gate over parameters that hold no bases would run as "
                   "dense; pass the parameters apply_gsi(params, bases, k) returns, or no "
                   "gate for dense")


def check_model(model) -> None:
  if not isinstance(model, Model):
    raise GSIError(f"model must be what load_model returns, got {type(model).__name__}")


def check_ids(input_ids, vocab_size: int, what: str = "input_ids", ndim: int = 2) -> jax.Array:
  """`input_ids` as int32, after checking that they are integers of rank `ndim` within the
  vocabulary: an id past the embedding table would read zeros or NaN, not fail."""
  if isinstance(input_ids, jax.core.Tracer):  # traced: only the static facts are known
    if not jnp.issubdtype(input_ids.dtype, jnp.integer) or input_ids.ndim != ndim:
      raise GSIError(f"{what} must be integer ids of rank {ndim}, got "
                     f"{input_ids.dtype} of rank {input_ids.ndim}")
    return input_ids.astype(jnp.int32)
  try:
    ids = np.asarray(input_ids)
  except ValueError:
    raise GSIError(f"{what} is ragged: every row must have the same number of tokens "
                   "(generate takes rows of different lengths; here, pass the rows one at "
                   "a time)") from None
  if ids.dtype == object or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
    raise GSIError(f"{what} must hold integer token ids, got {ids.dtype}")
  if ids.ndim != ndim:
    raise GSIError(f"{what} must have rank {ndim} ((batch, tokens) for rank 2), got shape "
                   f"{ids.shape}")
  if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    raise GSIError(f"{what} holds ids outside the vocabulary 0..{vocab_size - 1} "
                   f"(min {ids.min()}, max {ids.max()})")
  return jnp.asarray(ids, jnp.int32)


@dataclasses.dataclass
class Model:
  """What `gsi_jax.load_model` returns.

  `params` is a plain pytree; every method takes params explicitly so that
  transformed (GSI) parameters go through the same entry points.
  eos_ids: the end-of-sequence token ids greedy decoding stops at.
  bytes_read: what this process read of the checkpoint (a share of it when loaded onto a
  mesh of several processes).
  """
  config: ModelConfig
  params: Any
  tokenizer: Any = None
  dtype: Any = jnp.float32
  source: str = ""
  eos_ids: tuple[int, ...] = ()
  bytes_read: int = 0

  @functools.cached_property
  def module(self) -> Decoder:
    return Decoder(self.config, self.dtype)

  def check_length(self, tokens: int, what: str = "sequence") -> None:
    """A learned position table has a last row: refuse to read past it."""
    c = self.config
    if c.learned_positions and tokens + c.position_offset > c.learned_positions:
      raise GSIError(f"{what} of {tokens} tokens exceeds {c.name or c.family}'s "
                     f"{c.learned_positions - c.position_offset} positions")

  def ids(self, input_ids, what: str = "input_ids", ndim: int = 2) -> jax.Array:
    return check_ids(input_ids, self.config.vocab_size, what, ndim)

  def cache_tokens(self, prompt_tokens: int, new_tokens: int) -> int:
    """The KV cache `generate` allocates: the prompt padded to PROMPT_BUCKET tokens (not
    padded where a learned position table ends first), plus the new tokens."""
    c = self.config
    padded = -(-prompt_tokens // PROMPT_BUCKET) * PROMPT_BUCKET
    if c.learned_positions and padded + new_tokens + c.position_offset > c.learned_positions:
      padded = prompt_tokens
    return padded + new_tokens

  def check_cache_fits(self, batch: int, tokens: int) -> None:
    """Refuse a KV cache larger than the device's memory, before allocating it."""
    c = self.config
    need = 2 * c.n_layers * batch * tokens * c.kv_dim * jnp.dtype(self.dtype).itemsize
    have = device_memory_bytes()
    if need > have:
      raise GSIError(f"a KV cache for {batch} x {tokens} tokens needs {need / 2**30:.1f} GiB, "
                     f"more than this device's {have / 2**30:.1f} GiB; shorten the prompt or "
                     "max_new_tokens")

  def nonfinite(self, what: str) -> NonFiniteResult:
    """The error for NaN or inf where a result should be, naming the likely cause."""
    dtype = jnp.dtype(self.dtype).name
    cause = ("float16's range (65504) overflowed: load the model with dtype='bfloat16' or "
             "'float32'" if dtype == "float16" else "the weights or the gate's parameters "
             "hold NaN or inf, or the computation overflowed: check them")
    return NonFiniteResult(f"{what} hold NaN or inf in {dtype}; {cause}")

  def checked_ids(self, input_ids, what: str = "input_ids") -> jax.Array:
    """Token ids in the vocabulary, no longer than a learned position table."""
    ids = self.ids(input_ids, what)
    self.check_length(ids.shape[1], what)
    return ids

  def logits(self, params, input_ids, gate: Gate | None = None) -> jax.Array:
    """(B, T) int ids -> (B, T, vocab) float32 logits; NaN or inf ones are refused."""
    return self.forward(params, input_ids, gate, collections=())[0]

  def forward(self, params, input_ids, gate: Gate | None = None,
              collections: tuple[str, ...] = ("gate_stats",)):
    """Logits plus the sown collections ("gate_stats", "site_inputs"); NaN or inf logits
    are refused."""
    check_gate(gate, P.check_tree(params))
    logits, state = _forward(self.module, params, self.checked_ids(input_ids), gate,
                             tuple(collections))
    if not isinstance(logits, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(logits))):
      raise self.nonfinite("the logits")
    return logits, state

  def site_inputs(self, params, input_ids, gate: Gate | None = None) -> dict:
    """{layer: {site: x (B, T, d)}}: what every site's maps read in this forward."""
    _, state = self.forward(params, input_ids, gate, collections=(P.SITE_INPUTS,))
    return P.unwrap_sown(state[P.SITE_INPUTS])

  def generate(self, params, input_ids, max_new_tokens: int, gate: Gate | None = None,
               return_stats: bool = False, stop_at_eos: bool = True, until_differs=None,
               attention_mask=None):
    """Greedy decoding with a KV cache; returns prompt + new ids, (B, T + N).

    stop_at_eos (as transformers' generate): stop once every row has produced an
    end-of-sequence token, so N <= max_new_tokens; a row that finished earlier
    repeats its end-of-sequence token.  until_differs, (B, N) ids: also stop a row at its
    first token other than theirs (kept), so the output differs from them exactly where a
    full decode's would, which is all a comparison with a reference decode needs; the
    decode steps run the same program either way.  With return_stats, also the decode steps'
    gate statistics (the prompt's prefill excluded), which is what batch-1 decoding
    reads: per site the fast share ("fast_share_by_layer") and the mean (V columns,
    M rows) read ("rows_by_layer"), keyed as `metrics.score`'s for the byte formula.

    Prompts of different lengths: a list of id lists, or ids padded on the left with an
    attention_mask of zeros then ones (as transformers' tokenizers pad for generation).
    Each row decodes exactly as it would alone (the rows of one length decode together),
    and keeps its padding on the left of the output; a list's padding is the first
    end-of-sequence id (0 without one).
    """
    whole("max_new_tokens", max_new_tokens)
    return_stats, stop_at_eos = flag("return_stats", return_stats), flag("stop_at_eos",
                                                                        stop_at_eos)
    check_gate(gate, P.check_tree(params))
    ids, lengths = self._prompts(input_ids, attention_mask)
    decode = functools.partial(self._decode, params, max_new_tokens=int(max_new_tokens),
                               gate=gate, stats=return_stats, stop_at_eos=stop_at_eos)
    if lengths is None:
      out, counts = decode(ids, until_differs=until_differs)
    else:
      out, counts = self._decode_by_length(decode, ids, lengths, until_differs)
    if not return_stats:
      return out
    per_token = lambda read: jax.tree.map(lambda c: read(np.asarray(c) / max(float(c[1]), 1.0)),
                                          counts, is_leaf=lambda x: isinstance(x, jax.Array))
    return out, {"fast_share_by_layer": per_token(lambda c: float(c[0])),
                 "rows_by_layer": per_token(lambda c: (float(c[2]), float(c[3])))}

  def _prompts(self, input_ids, attention_mask):
    """(ids (B, T), each row's prompt length or None where every row fills T)."""
    rows_are_lists = isinstance(input_ids, (list, tuple)) and all(
        isinstance(row, (list, tuple, np.ndarray)) for row in input_ids)
    if attention_mask is None and rows_are_lists and len(set(map(len, input_ids))) > 1:
      T, pad = max(map(len, input_ids)), (self.eos_ids or (0,))[0]
      attention_mask = [[0] * (T - len(row)) + [1] * len(row) for row in input_ids]
      input_ids = [[pad] * (T - len(row)) + list(row) for row in input_ids]
    ids = self.ids(input_ids, "the prompt")
    if ids.shape[1] == 0:
      raise GSIError("generate takes a (batch, tokens) prompt of at least one token, "
                     f"got shape {ids.shape}")
    if attention_mask is None:
      return ids, None
    mask = np.asarray(attention_mask)
    if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
      raise GSIError(f"attention_mask must be 0s and 1s of the prompt's shape {ids.shape}, "
                     f"got {mask.dtype} of shape {mask.shape}")
    lengths = mask.sum(1).astype(int)
    left_padded = (mask == (np.arange(ids.shape[1]) >= ids.shape[1] - lengths[:, None])).all()
    if not left_padded or lengths.min() < 1:
      raise GSIError("attention_mask must pad on the left (zeros, then at least one 1 a row), "
                     "as a tokenizer does with padding_side='left'")
    return ids, None if (lengths == ids.shape[1]).all() else lengths

  @staticmethod
  def _decode_by_length(decode, ids, lengths, until_differs):
    """Each length's rows decoded together, alone, then laid back in their order: a row
    that stopped before the longest repeats its last token."""
    T, parts, counts = ids.shape[1], [], None
    until = None if until_differs is None else np.asarray(until_differs)
    if until is not None and (until.ndim != 2 or len(until) != len(ids)):
      raise GSIError(f"until_differs takes ({len(ids)}, tokens) ids, got shape {until.shape}")
    for length in sorted(set(lengths.tolist())):
      rows = np.flatnonzero(lengths == length)
      out, part_counts = decode(ids[rows, T - length:],
                                until_differs=None if until is None else until[rows])
      parts.append((rows, np.asarray(out)[:, length:]))
      counts = part_counts if counts is None else jax.tree.map(jnp.add, counts, part_counts)
    width = max(new.shape[1] for _, new in parts)
    out = np.zeros((len(ids), T + width), np.int32)
    out[:, :T] = np.asarray(ids)
    for rows, new in parts:
      out[rows, T:] = np.concatenate([new, np.repeat(new[:, -1:], width - new.shape[1], 1)], 1)
    return jnp.asarray(out), counts

  def _decode(self, params, ids, *, max_new_tokens: int, gate, stats: bool, stop_at_eos: bool,
              until_differs):
    """generate for prompts of one length: (prompt + new ids, the steps' summed counts)."""
    T, N = ids.shape[1], max_new_tokens
    self.check_length(T + N, "prompt plus new tokens")
    L = self.cache_tokens(T, N) - N  # the padded prompt
    self.check_cache_fits(ids.shape[0], L + N)
    # Never-matching ids of the same shape: decoding with and without the stop shares
    # one compiled program.
    eos = jnp.asarray(self.eos_ids if stop_at_eos else (-1,) * len(self.eos_ids), jnp.int32)
    expected = np.full((ids.shape[0], N), -1, np.int32)
    if until_differs is not None:
      reference = np.asarray(until_differs)
      if reference.ndim != 2 or reference.shape[0] != ids.shape[0]:
        raise GSIError(f"until_differs takes ({ids.shape[0]}, tokens) ids, got shape "
                       f"{reference.shape}")
      n = min(N, reference.shape[1])
      expected[:, :n] = reference[:, :n]
    new, steps, counts = _generate(self.module, params, jnp.pad(ids, ((0, 0), (0, L - T))),
                                   jnp.int32(T), decode_gate(params, gate, stats), N,
                                   eos, jnp.asarray(expected), stats=stats)
    bad = np.argwhere(np.asarray(new[:, :int(steps)]) == NONFINITE)
    if bad.size:
      raise self.nonfinite(f"the logits of new token {bad[:, 1].min() + 1} of {N}")
    return jnp.concatenate([ids, new[:, :int(steps)]], axis=1), counts

  def encode(self, text: str) -> np.ndarray:
    if self.tokenizer is None:
      raise GSIError(f"{self.source} has no tokenizer; pass token ids instead")
    return np.asarray(self.tokenizer(text)["input_ids"], np.int32)

  def decode(self, ids) -> str:
    if self.tokenizer is None:
      raise GSIError(f"{self.source} has no tokenizer; read the token ids instead")
    return self.tokenizer.decode(list(np.asarray(ids)), skip_special_tokens=False)
