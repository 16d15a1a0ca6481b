"""Tile plans of the Pallas kernels: one table per platform, the byte model and the
bandwidth model.

A `TilePlan` fixes what one program loads per loop step; `layout` fits it to a
call: one call serves every map of a site (q, k and v; gate and up), their
output blocks side by side on the grid.  Block sizes shrink to the (power-of-two
ceiling of the) array.  The chip is filled by splitting the reduction in powers of
two until the grid has min_programs programs; each split writes float32 partial
sums that XLA adds.  M's k rows are split with W's d rows, so each split reads
its share of M in tiles of at most block_k rows (at GPT-J's k = 256, one tile: no
loop on the fast path).
  * decode (one token per program): wide output blocks (256 outputs, 512-byte
    row pieces of bf16) and a split reduction, at least 4 programs per SM (2 per
    CU), so that Little's law holds with several programs resident;
  * batch (2 to 64 tokens: one block of them, so no weight tile is read twice
    whatever the gates), prefill (more tokens, 32 per block) and tpu: tensor-core
    dot tiles, pipelined (num_stages) where the loads feed the dot.
A padded row, column or token is masked, never read.

Per platform (targets: H200, sm_90, 132 SMs; MI300X, gfx942, 304 CUs, 64 KB LDS;
TPU: Mosaic, whole panels in VMEM):

| platform | regime  | block_t × block_o, block_d, block_k; warps, stages | W tile (bf16 KiB) |
|----------|---------|-----------------------------------------------|-------------------|
| cuda     | decode  | 1 × 256, 32, 64; 4 warps; ≥ 528 programs      | 16                |
| cuda     | batch   | 16–64 × 128, 64, 64; 8 warps, 3 stages        | 16                |
| cuda     | prefill | 32 × 64, 64, 32; 4 warps, 3 stages            | 8                 |
| rocm     | decode  | 1 × 256, 64, 128; 4 warps; ≥ 608 programs     | 32                |
| rocm     | batch   | 16–64 × 128, 64, 64; 4 warps, 2 stages        | 16                |
| rocm     | prefill | 32 × 64, 32, 32; 4 warps, 2 stages            | 4                 |
| tpu      | all     | 16 × 128, 512, 128; padded inputs             | 128               |

Bandwidth (Little's law): to stream at B bytes/s with a memory latency of L seconds a
chip keeps B·L bytes in flight.  A decode program's loop issues one tile's loads and
waits for them, so a unit keeps tile bytes × the programs resident on it;
`bytes_in_flight` states it per SM or CU (`CHIPS`), and `benchmarks/gpu_lowering.py`
reads the programs resident from each compiled binary.

`python benchmarks/gpu_lowering.py` compiles every plan to sm_90 and gfx942 binaries
and reports their registers, spills, shared memory, and what their main loops hold.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

PLATFORMS = ("cuda", "rocm", "tpu")
BATCH_TOKENS = 64  # calls of 2 to this many tokens are one token block: each tile read once
MIN_BLOCK = 16  # Triton's dot needs every dimension >= 16


@dataclasses.dataclass(frozen=True)
class TilePlan:
  """What one program loads per loop step, and how the call is launched.

  block_t: tokens per program; 1 is a matrix-vector product per token (multiply
  and add into a 2-D float32 accumulator, summed once after the loop: no
  reduction, so no barrier or shuffle, inside it), >= 16 a tensor-core dot.
  block_o: outputs per program.  block_d / block_k: rows of W / M per loop step,
  as bf16 (float32 weights take half as many, so a tile keeps its bytes).
  min_programs: the reduction is split in powers of two until a call has this
  many programs.  eviction_hints: weights are loaded evict-first (each byte is
  read once) and activations evict-last (every program rereads them).
  pad_inputs: Mosaic (TPU) has no masked loads, so ragged arrays are padded in XLA
  (a copy) instead of masked in the kernel.
  """
  block_t: int
  block_o: int
  block_d: int
  block_k: int
  min_programs: int = 1
  num_warps: int | None = None
  num_stages: int | None = None
  pad_inputs: bool = False
  eviction_hints: bool = False


_H200_SMS, _MI300X_CUS = 132, 304
TILE_PLANS: dict[str, dict[str, TilePlan]] = {
    "cuda": {"decode": TilePlan(1, 256, 32, 64, 4 * _H200_SMS, num_warps=4, num_stages=1,
                                eviction_hints=True),
             "batch": TilePlan(64, 128, 64, 64, 2 * _H200_SMS, num_warps=8, num_stages=3,
                               eviction_hints=True),
             "prefill": TilePlan(32, 64, 64, 32, 2 * _H200_SMS, num_warps=4, num_stages=3,
                                 eviction_hints=True)},
    "rocm": {"decode": TilePlan(1, 256, 64, 128, 2 * _MI300X_CUS, num_warps=4, num_stages=1,
                                eviction_hints=True),
             "batch": TilePlan(64, 128, 64, 64, 2 * _MI300X_CUS, num_warps=4, num_stages=2,
                               eviction_hints=True),
             "prefill": TilePlan(32, 64, 32, 32, 2 * _MI300X_CUS, num_warps=4, num_stages=2,
                                 eviction_hints=True)},
    "tpu": {regime: TilePlan(16, 128, 512, 128, pad_inputs=True)
            for regime in ("decode", "batch", "prefill")},
}


def plan_for(platform: str, tokens: int) -> TilePlan:
  if platform not in TILE_PLANS:
    raise ValueError(f"no tile plan for platform {platform!r}; one of {tuple(TILE_PLANS)}")
  return TILE_PLANS[platform][regime(tokens)]


def regime(tokens: int) -> str:
  """decode: one token; batch: 2 to BATCH_TOKENS, one block of them; prefill: more."""
  return "decode" if tokens == 1 else "batch" if tokens <= BATCH_TOKENS else "prefill"


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
  """A plan fitted to one call: x (tokens, d), and per map M (k, out) and W (d, out) or
  (out, d); every map's output blocks share block_o.

  The grid is (token blocks, output blocks of every map in turn, splits); split s
  reduces rows [s d_chunk, (s + 1) d_chunk) of W and [s k_chunk, (s + 1) k_chunk) of M.
  Arrays keep their true shapes (`padded_*` differ only with pad_inputs).
  """
  plan: TilePlan
  tokens: int
  d: int
  k: int
  outs: tuple[int, ...]
  block_t: int
  block_o: int
  block_d: int
  block_k: int
  splits: int
  d_chunk: int
  k_chunk: int
  m_cols: tuple[int, ...] = ()  # per map, M's stored columns where padded past out, else 0

  @property
  def token_blocks(self) -> int:
    return _ceil_div(self.tokens, self.block_t)

  @property
  def padded_outs(self) -> tuple[int, ...]:
    if not self.plan.pad_inputs:
      return self.outs
    return tuple(_ceil_div(o, self.block_o) * self.block_o for o in self.outs)

  @property
  def map_blocks(self) -> tuple[int, ...]:
    """Output blocks per map."""
    return tuple(_ceil_div(o, self.block_o) for o in self.padded_outs)

  @property
  def map_starts(self) -> tuple[int, ...]:
    """The first output block of each map on the grid."""
    return tuple(sum(self.map_blocks[:m]) for m in range(len(self.outs)))

  @property
  def out_blocks(self) -> int:
    return sum(self.map_blocks)

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
    """Output columns of every map together."""
    return sum(self.padded_outs)

  @property
  def mask_d(self) -> bool:
    """Rows of W past d exist in some split's chunk: loads are masked."""
    return self.splits * self.d_chunk != self.padded_d

  @property
  def mask_k(self) -> bool:
    return self.splits * self.k_chunk != self.padded_k

  @property
  def mask_outs(self) -> tuple[bool, ...]:
    """Per map: its last output block ends past its columns."""
    return tuple(b * self.block_o != o for b, o in zip(self.map_blocks, self.padded_outs))

  @property
  def mask_m_cols(self) -> tuple[bool, ...]:
    """Per map: M's loads need a column mask, its stored columns ending inside the last
    block (a column mask along the contiguous axis turns a program's vector loads scalar)."""
    return tuple(b * self.block_o > max(m, o)
                 for b, m, o in zip(self.map_blocks, self.m_cols, self.padded_outs))


def _as_tuple(n, maps: int) -> tuple[int, ...]:
  return (n,) * maps if isinstance(n, int) else tuple(n)


def layout(plan: TilePlan, tokens: int, d: int, k: int, out, m_cols=0,
           itemsize: int = 2) -> CallLayout:
  """Fit `plan` to one call: `out` one map's outputs or a sequence, one per map sharing
  x; m_cols M's stored columns where padded past out (an int for one map, or per map);
  itemsize the weights' bytes per element.  The chip is filled by splitting the
  reduction (see the module); M's rows split with W's."""
  outs = _as_tuple(out, 1)
  m_cols = tuple(m if m > o else 0 for m, o in zip(_as_tuple(m_cols, len(outs)), outs))
  block_t = plan.block_t if plan.block_t == 1 or plan.pad_inputs else \
      max(MIN_BLOCK, min(plan.block_t, _pow2_at_least(tokens)))
  token_blocks = _ceil_div(tokens, block_t)
  block_o = _block(plan.block_o, max(outs), plan.pad_inputs)
  output_blocks = token_blocks * sum(_ceil_div(o, block_o) for o in outs)
  as_bf16 = lambda rows: max(1, rows * 2 // itemsize)  # the tile keeps its bytes
  block_d = _block(as_bf16(plan.block_d), d, plan.pad_inputs)
  d_tiles = _ceil_div(d, block_d)
  splits = 1
  while output_blocks * splits < plan.min_programs and splits * 2 <= d_tiles:
    splits *= 2
  d_chunk_tiles = _ceil_div(d_tiles, splits)
  splits = _ceil_div(d_tiles, d_chunk_tiles)  # no split left without rows of W
  k_rows = _ceil_div(k, splits)  # each split's share of M's rows
  block_k = _block(as_bf16(plan.block_k), k_rows, plan.pad_inputs)
  return CallLayout(plan, tokens, d, k, outs, block_t, block_o, block_d, block_k, splits,
                    d_chunk=d_chunk_tiles * block_d,
                    k_chunk=_ceil_div(k_rows, block_k) * block_k, m_cols=m_cols)


@dataclasses.dataclass(frozen=True)
class Chip:
  """What Little's law needs of a chip: read bandwidth (bytes/s), SMs or CUs, and the
  latency of a read from HBM under load (seconds; assumed, not measured here)."""
  name: str
  bandwidth: float
  units: int
  latency: float

  @property
  def needed_in_flight(self) -> float:
    """Bytes each SM or CU must keep in flight to stream at full bandwidth: B L / units."""
    return self.bandwidth * self.latency / self.units


# 800 ns: a loaded HBM read on both chips, rounded up from the 500-700 ns that
# microbenchmarks commonly report; gpu_check.sh measures the bandwidth, not this.
CHIPS = {"cuda": Chip("H200", 4.8e12, _H200_SMS, 800e-9),
         "rocm": Chip("MI300X", 5.3e12, _MI300X_CUS, 800e-9)}


def bytes_in_flight(lay: CallLayout, itemsize: int, chip: Chip, resident: int = 1) -> float:
  """Bytes of weights one SM or CU keeps in flight on the slow path: one W tile per
  program (the loop issues a step's loads together and waits for them), times the
  programs at once, min(programs, units × resident), spread over the units."""
  at_once = min(lay.programs, chip.units * resident)
  return lay.block_d * lay.block_o * itemsize * at_once / chip.units


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
