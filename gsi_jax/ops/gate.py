"""The gate: which tokens take GSI's fast path, and how a site computes.

For x with calibrated orthonormal V_k and g = V_kᵀ x, the residual r = x − V_k g
has ‖r‖² = ‖x‖² − ‖g‖², so V_k is read once per token.  A token is fast when
ρ = ‖r‖ / ‖x‖ < ε, written without a division: ε = 0 never fires, ε = ∞ always.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp

from gsi_jax.errors import GSIError, flag, number
from gsi_jax.ops.fused_sum import fused_sum

MODES = ("gated", "static", "dense", "soft", "coin")
# Widths of the smooth gates, in units of ρ² (GSI) and of the threshold (sparsity).
SOFT_GATE_WIDTH, SOFT_KEEP_WIDTH = 0.01, 0.1
IMPLS = ("xla", "pallas", "auto")


@flax.struct.dataclass
class Gate:
  """How every GSI site (and a GSI LM head) computes its outputs.

  eps and head_eps are traced, so sweeping them does not recompile; the rest
  is static.  head_eps gates a GSI LM head (None: eps).
  mode: "gated" (the paper), "static" (always M g: the negative control),
  "dense" (ignore the bases), "soft" (for learning per-site budgets,
  `gsi_jax.peers.allocation`: the hard gate and threshold in the forward pass, with
  the gradients of their smooth versions `soft_fast` and `soft_keep`) or "coin"
  (a speed instrument: each token fast with probability eps, whatever its
  residual, `coin_fast`).
  impl: "auto" (the default: the Pallas kernels where the program is lowered for
  a GPU or TPU, xla where it is lowered for cpu), "xla" (a masked select; with
  batch1_switch a lax.switch that runs only the branch the gate picks) or
  "pallas" (the kernels everywhere: they read M's or W's tiles, or W's kept
  rows, only as the tokens require; Triton on cuda and rocm, Mosaic on tpu,
  interpret mode on cpu); each chosen by the platform the program is lowered for.
  batch1_switch: on "xla", branch on the call's gate pattern (all fast, mixed,
  all slow), which skips W's bytes when every token is fast: at batch-1
  decoding, one token per call, that is every fast step.
  eps_positive: every threshold the sites read is known to be > 0 (set by
  `gsi_jax.models.model.decode_gate` from concrete values), so no site branches on
  ε ≤ 0: a decode then has no per-site conditional.
  """
  eps: jax.Array
  head_eps: jax.Array | None = None
  mode: str = flax.struct.field(pytree_node=False, default="gated")
  impl: str = flax.struct.field(pytree_node=False, default="auto")
  batch1_switch: bool = flax.struct.field(pytree_node=False, default=False)
  eps_positive: bool = flax.struct.field(pytree_node=False, default=False)


def check_threshold(name: str, value) -> float:
  """A gate threshold: a number >= 0, inf allowed (a string or a bool is not a number)."""
  try:
    value = float(number(name, value))
  except (GSIError, TypeError):  # TypeError: a traced value
    raise GSIError(f"{name} must be a number >= 0 (inf allowed), got {value!r}") from None
  if math.isnan(value) or value < 0:
    raise GSIError(f"{name} must be a number >= 0 (inf allowed), got {value}")
  return value


def check_impl(impl: str) -> str:
  if impl not in IMPLS:
    raise GSIError(f"gate impl {impl!r} is not one of {IMPLS}")
  return impl


def make_gate(eps: float, mode: str = "gated", *, impl: str = "auto", batch1_switch: bool = False,
              head_eps: float | None = None) -> Gate:
  if mode not in MODES:
    raise GSIError(f"gate mode {mode!r} is not one of {MODES}")
  head = None if head_eps is None else jnp.float32(check_threshold("head_eps", head_eps))
  return Gate(eps=jnp.float32(check_threshold("eps", eps)), head_eps=head, mode=mode,
              impl=check_impl(impl), batch1_switch=flag("batch1_switch", batch1_switch))


def energy(x_BTD: jax.Array) -> jax.Array:
  """‖x‖² per token, in float32."""
  return jnp.sum(jnp.square(x_BTD.astype(jnp.float32)), -1)


def project_rows(x_BTD: jax.Array, V_KD: jax.Array, with_energy: bool = False) -> jax.Array:
  """g = x V_k in float32 from V_kᵀ (k, d), as products summed over d: a row reduction that
  XLA's GPU compiler emits as one kernel at any number of tokens (a dot of several tokens
  is a GEMM and its split-K sum, two).  with_energy: ‖x‖² from the same reduction, as a
  (k+1)-th column (x itself as one more row of V_kᵀ)."""
  x32 = x_BTD.astype(jnp.float32)[..., None, :]
  V32 = V_KD.astype(jnp.float32).reshape((1,) * (x_BTD.ndim - 1) + V_KD.shape)
  products = jnp.concatenate([V32 * x32, jnp.square(x32)], -2) if with_energy else V32 * x32
  return jnp.sum(products, -1)


def energy_gate(gx, eps, *, fused: bool) -> jax.Array:
  """ρ < ε per token (`fires`) from g with ‖x‖² as its last column (`project_rows`
  with_energy).  fused: ‖g‖² is added by halves, which XLA's GPU compiler fuses into the
  select (`fused_sum`: a reduce over k would be a kernel of its own); else a reduce."""
  squares = jnp.square(gx[..., :-1].astype(jnp.float32))
  gg = fused_sum(jnp.moveaxis(squares, -1, 0)) if fused else jnp.sum(squares, -1)
  return fires(gx[..., -1] - gg, gx[..., -1], eps)


def residual_energy(x_BTD: jax.Array, g_BTK: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(‖x‖², ‖r‖²) per token in float32, from x and g = V_kᵀ x."""
  xx = energy(x_BTD)
  gg = jnp.sum(jnp.square(g_BTK.astype(jnp.float32)), -1)
  return xx, xx - gg


def fires(rr, xx, eps) -> jax.Array:
  """‖r‖ < ε ‖x‖ from squared norms, as every gate reads it: never at ε <= 0; always for
  x = 0 (where M g = x W = 0), which the product ε² ‖x‖² misses (0 < 0 is false, and at
  ε = ∞, ∞ · 0 is NaN); so ε = ∞ fires for every token."""
  eps = jnp.asarray(eps, jnp.float32)
  return jnp.where(xx > 0, rr < jnp.square(eps) * xx, True) & (eps > 0)


def gate_mask(x_BTD: jax.Array, g_BTK: jax.Array, eps) -> jax.Array:
  """ρ < ε per token, as ‖r‖² < ε² ‖x‖² (`fires`: never at ε = 0, always at ε = ∞)."""
  xx, rr = residual_energy(x_BTD, g_BTK)
  return fires(rr, xx, eps)


def straight_through(hard: jax.Array, soft: jax.Array) -> jax.Array:
  """The hard value forward, the soft one's gradient backward."""
  return hard.astype(soft.dtype) + soft - jax.lax.stop_gradient(soft)


def soft_fast(x_BTD: jax.Array, g_BTK: jax.Array, eps) -> jax.Array:
  """A smooth ρ < ε in (0, 1): σ((ε² − ρ²) / SOFT_GATE_WIDTH); differentiable in ε."""
  xx, rr = residual_energy(x_BTD, g_BTK)
  return jax.nn.sigmoid((jnp.square(eps) - rr / jnp.maximum(xx, 1e-30)) / SOFT_GATE_WIDTH)


def soft_keep(x_BTD: jax.Array, threshold) -> jax.Array:
  """A smooth |x| >= t in (0, 1): σ((|x| − t) / (SOFT_KEEP_WIDTH · t)); differentiable in t."""
  t = jnp.maximum(threshold, 1e-12)
  return jax.nn.sigmoid((jnp.abs(x_BTD.astype(jnp.float32)) - t) / (SOFT_KEEP_WIDTH * t))


def output_gate_mask(x_BTD, g_BTK, C_DS, D_KS, eps) -> jax.Array:
  """Output-aware gate (beyond the paper): ‖W r‖ < ε ‖W x‖, read through a sketch.

  C = W Ω and D = V_kᵀ C for a random Ω with s orthonormal columns, so
  x C − g D = r W Ω and x C = x W Ω: s columns stand in for all of W's outputs.
  """
  xc = (x_BTD @ C_DS).astype(jnp.float32)
  e = xc - (g_BTK @ D_KS).astype(jnp.float32)
  return fires(jnp.sum(e * e, -1), jnp.sum(xc * xc, -1), eps)


def coin_fast(x_BTD: jax.Array, p) -> jax.Array:
  """Fast with probability p per token, whatever its residual: the gate's pattern at a
  chosen rate with its decision left out, for timing.  Each token's coin is its ‖x‖²'s
  bits through murmur3's 32-bit finalizer, so every site and decode step flips its own,
  with one reduction and elementwise integer steps that XLA fuses into what reads them
  (a threefry key per token is dozens of kernels on a GPU)."""
  h = jax.lax.bitcast_convert_type(energy(x_BTD), jnp.uint32)
  for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
    h = (h ^ (h >> shift)) * jnp.uint32(multiplier)
  h = h ^ (h >> 16)
  return (h >> 8).astype(jnp.float32) * 2.0 ** -24 < p  # 24 uniform bits in [0, 1)


def ladder_ranks(x_BTD, g_BTK, rungs_R, eps) -> tuple[jax.Array, jax.Array]:
  """Rank ladder (beyond the paper): per token, the smallest rung k_j with ‖r_j‖ < ε ‖x‖.

  Bases are nested (V_{k_j} is V's first k_j columns), so every rung's
  ‖r_j‖² = ‖x‖² − ‖g[:k_j]‖² is one product of g² with a K × R mask of prefixes (a
  cumulative sum lowers to a while loop on GPUs).  Returns the fast mask and the rank
  used; a slow token's rank is the top rung.
  """
  xx = jnp.sum(jnp.square(x_BTD.astype(jnp.float32)), -1)[..., None]
  prefix_KR = (jnp.arange(g_BTK.shape[-1])[:, None] < rungs_R[None, :]).astype(jnp.float32)
  gg_BTR = jnp.dot(jnp.square(g_BTK.astype(jnp.float32)), prefix_KR,
                   precision=jax.lax.Precision.HIGHEST)
  pass_BTR = fires(xx - gg_BTR, xx, eps)
  fast_BT = jnp.any(pass_BTR, -1)
  rank_BT = jnp.where(fast_BT, rungs_R[jnp.argmax(pass_BTR, -1)], rungs_R[-1])
  return fast_BT, rank_BT
