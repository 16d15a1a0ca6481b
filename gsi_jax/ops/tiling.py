"""Tile plans of the gated matmul kernel: one table per platform, and the byte model.

A `TilePlan` fixes what one program loads per loop step; `layout` fits it to a
call's shapes: block sizes shrink to the (power-of-two ceiling of the) array,
and the reduction dimension is split across programs until the grid fills the
chip (`min_programs`).  Each split program writes float32 partial sums that
XLA adds up; a padded row, column or token is masked, never read.

Per platform (targets: H200, sm_90, 132 SMs, 227 KB shared memory per SM;
MI300X, gfx942, 304 CUs, 64 KB LDS; TPU: Mosaic, whole panels in VMEM):

| platform | regime  | block_t × block_o, block_d, block_k | elements per W tile | programs at d = O = 4096, k = 256 |
|----------|---------|-------------------------------------|---------------------|-----------------------------------|
| cuda     | decode  | 1 × 64, 64, 32                      | 4096                | 1 token: 64 × 8 splits = 512       |
| cuda     | prefill | 32 × 64, 64, 32                     | 4096                | 16 tokens: 64 × 8 = 512; 2048: 4096 |
| rocm     | decode  | 1 × 64, 64, 32                      | 4096                | 1 token: 64 × 16 splits = 1024     |
| rocm     | prefill | 32 × 64, 32, 32                     | 2048                | 16 tokens: 64 × 16 = 1024; 2048: 4096 |
| tpu      | both    | 16 × 128, 512, 128                  | 65536               | 1 token: 32 (no split)            |

`python benchmarks/kernel_binaries.py` compiles every plan to sm_90 and gfx942
binaries and reports their registers, spills and shared memory.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

PLATFORMS = ("cuda", "rocm", "tpu")
PREFILL_TOKENS = 16  # calls with at least this many tokens use the prefill plan (tensor cores)
MIN_BLOCK = 16  # Triton's dot needs every dimension >= 16


@dataclasses.dataclass(frozen=True)
class TilePlan:
  """What one program of the kernel loads per loop step, and how the call is launched.

  block_t: tokens per program; 1 is a matrix-vector product per token (multiply
  and sum, no tensor cores), >= 16 a tensor-core dot.  block_o: outputs per
  program.  block_d / block_k: rows of W / M per loop step.  min_programs: the
  reduction is split in powers of two until a call has this many programs
  (2 per SM or CU).  pad_inputs: Mosaic (TPU) has no masked loads, so ragged
  arrays are padded in XLA (a copy) instead of masked in the kernel.
  """
  block_t: int
  block_o: int
  block_d: int
  block_k: int
  min_programs: int = 1
  num_warps: int | None = None
  num_stages: int | None = None
  pad_inputs: bool = False


_H200_SMS, _MI300X_CUS = 132, 304
TILE_PLANS: dict[str, dict[str, TilePlan]] = {
    "cuda": {"decode": TilePlan(1, 64, 64, 32, 2 * _H200_SMS, num_warps=4, num_stages=3),
             "prefill": TilePlan(32, 64, 64, 32, 2 * _H200_SMS, num_warps=4, num_stages=3)},
    "rocm": {"decode": TilePlan(1, 64, 64, 32, 2 * _MI300X_CUS, num_warps=4, num_stages=2),
             "prefill": TilePlan(32, 64, 32, 32, 2 * _MI300X_CUS, num_warps=4, num_stages=2)},
    "tpu": {"decode": TilePlan(16, 128, 512, 128, pad_inputs=True),
            "prefill": TilePlan(16, 128, 512, 128, pad_inputs=True)},
}


def plan_for(platform: str, tokens: int) -> TilePlan:
  if platform not in TILE_PLANS:
    raise ValueError(f"no tile plan for platform {platform!r}; one of {tuple(TILE_PLANS)}")
  return TILE_PLANS[platform]["prefill" if tokens >= PREFILL_TOKENS else "decode"]


def compiler_params(platform: str, plan: TilePlan):
  """The pallas_call compiler params for a platform: Triton on cuda and rocm, Mosaic on tpu."""
  if platform in ("cuda", "rocm"):
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages)
  if platform == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams()
  raise ValueError(f"no compiler params for platform {platform!r}")


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _block(cap: int, n: int, pad_inputs: bool) -> int:
  if pad_inputs:
    return cap
  return max(MIN_BLOCK, min(cap, _pow2_at_least(n)))


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class CallLayout:
  """A plan fitted to one call: x (tokens, d), M (k, out), W (d, out) or (out, d).

  The grid is (token blocks, output blocks, splits); split s reduces rows
  [s d_chunk, (s + 1) d_chunk) of W and [s k_chunk, (s + 1) k_chunk) of M.
  Arrays keep their true shapes (`padded_*` differ only with pad_inputs).
  """
  plan: TilePlan
  tokens: int
  d: int
  k: int
  out: int
  block_t: int
  block_o: int
  block_d: int
  block_k: int
  splits: int
  d_chunk: int
  k_chunk: int
  m_cols: int = 0  # M's stored columns when padded past out (a GSI LM head), else 0

  @property
  def token_blocks(self) -> int:
    return _ceil_div(self.tokens, self.block_t)

  @property
  def out_blocks(self) -> int:
    return _ceil_div(self.padded_out, self.block_o)

  @property
  def grid(self) -> tuple[int, int, int]:
    return self.token_blocks, self.out_blocks, self.splits

  @property
  def programs(self) -> int:
    return math.prod(self.grid)

  @property
  def padded_tokens(self) -> int:
    return self.token_blocks * self.block_t

  @property
  def padded_d(self) -> int:
    return _ceil_div(self.d, self.block_d) * self.block_d if self.plan.pad_inputs else self.d

  @property
  def padded_k(self) -> int:
    return _ceil_div(self.k, self.block_k) * self.block_k if self.plan.pad_inputs else self.k

  @property
  def padded_out(self) -> int:
    return _ceil_div(self.out, self.block_o) * self.block_o if self.plan.pad_inputs else self.out

  @property
  def mask_d(self) -> bool:
    """Rows of W past d exist in some split's chunk: loads are masked."""
    return self.splits * self.d_chunk != self.padded_d

  @property
  def mask_k(self) -> bool:
    return self.splits * self.k_chunk != self.padded_k

  @property
  def mask_out(self) -> bool:
    return self.out_blocks * self.block_o != self.padded_out

  @property
  def mask_m_cols(self) -> bool:
    """M's loads need a column mask: its stored columns end inside the last block (a
    column mask along the contiguous axis turns a program's vector loads scalar)."""
    return self.out_blocks * self.block_o > max(self.m_cols, self.padded_out)


def layout(plan: TilePlan, tokens: int, d: int, k: int, out: int, m_cols: int = 0) -> CallLayout:
  """Fit `plan` to one call's shapes, splitting the reduction until the grid fills the chip.
  m_cols: M's stored columns where they are padded past `out`."""
  block_d = _block(plan.block_d, d, plan.pad_inputs)
  block_k = _block(plan.block_k, k, plan.pad_inputs)
  block_o = _block(plan.block_o, out, plan.pad_inputs)
  block_t = plan.block_t if plan.block_t == 1 or plan.pad_inputs else \
      max(MIN_BLOCK, min(plan.block_t, _pow2_at_least(tokens)))
  d_tiles, k_tiles = _ceil_div(d, block_d), _ceil_div(k, block_k)
  others = _ceil_div(tokens, block_t) * _ceil_div(out, block_o)
  splits = 1
  while others * splits < plan.min_programs and splits * 2 <= d_tiles:
    splits *= 2
  d_chunk_tiles = _ceil_div(d_tiles, splits)
  splits = _ceil_div(d_tiles, d_chunk_tiles)  # no split left without rows of W
  return CallLayout(plan, tokens, d, k, out, block_t, block_o, block_d, block_k, splits,
                    d_chunk=d_chunk_tiles * block_d,
                    k_chunk=_ceil_div(k_tiles, splits) * block_k,
                    m_cols=m_cols if m_cols > out else 0)


def weight_elements_read(lay: CallLayout, fast_T) -> float:
  """Elements of M and W one call reads: a token block reads all of M (k × out) when one
  of its tokens is fast and all of W (d × out) when one is slow; masked lanes read
  nothing, padded tokens are neither (with pad_inputs the padded arrays are what is
  read, and the pad is a copy on top).  V_k (read once per call, by XLA, for g) and the
  activations (x, g, partial sums) are not counted here.  With block_t = 1 this is
  exactly Σ_t (fast_t k out + (1 − fast_t) d out), the per-token count of
  `gsi_jax.metrics.bytes.gated_map_elements` without V_k's d k."""
  fast = np.asarray(fast_T, bool).reshape(-1)
  blocks = np.full(lay.padded_tokens, -1)
  blocks[:fast.size] = fast
  blocks = blocks.reshape(lay.token_blocks, lay.block_t)
  any_fast = np.sum(np.any(blocks == 1, axis=1))
  any_slow = np.sum(np.any(blocks == 0, axis=1))
  return float(any_fast * lay.padded_k * lay.padded_out + any_slow * lay.padded_d * lay.padded_out)
