"""Where a batch-1 kept-rows product loses to its byte ideal on XLA's CPU backend.

  python benchmarks/sparse_rows.py --out results/benchmarks/sparse_rows.json

y = Σ_{i kept} x_i W_i, one token at a time, for ways of reading only the kept rows:
  masked   x·keep @ W: reads every row (the dense-equivalent floor);
  gather   `kept_rows_matmul_xla`: the kept indices gathered into one of 8 bucket sizes
           chosen by a lax.switch, then a dot on the gathered copy of W's rows;
  reduce   the same buckets, but Σ x_S W[idx] as one fused multiply-reduce, so the
           rows are read where they lie instead of being copied first;
  blocks   W's rows in contiguous blocks of --block rows, a block kept when any of its
           rows is; a fori_loop over the kept blocks adds x_b W_b, each block a dynamic
           slice of W (no gather);
  kernel   `kept_rows_matmul`'s CPU kernel (`gsi_jax.ops.cpu_kernels`, XLA's FFI):
           each kept row streamed once, in place;
  dots     the other product of that kernel, `kept_dots`: y_i = W_i · x' for kept i (CATS'
           up projection, W_up stored transposed), with x' the token tiled to O.
Dense x @ W runs in the same process on the same copies, alternating with each variant in
--repeats paired rounds (the median ratio and its 95% interval).  Weights are cache-cold: the
scan cycles through enough distinct copies of W to exceed --cache_multiple × the
last-level cache, or --copies.  Byte ideal: d / rows read (kept rows, or kept blocks'
rows); `of_ideal` = measured speedup / ideal.
"""

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax import lax

from gsi_jax import cli, experiment
from gsi_jax.measure.benchmarking import (interval_fields, last_level_cache_bytes, ratio_text,
                                  scan_over_copies, timed_pair)
from gsi_jax.errors import GSIError
from gsi_jax.ops import cpu_kernels
from gsi_jax.ops.sparse_rows import bucket_sizes, kept_rows_matmul_xla

_SHAPES = flags.DEFINE_list("shapes", ["576x3072", "1536x576"],
                            "d x O of W (SmolLM2-135M's mlp_in and mlp_out).")
_KEPT = flags.DEFINE_list("kept", ["0.25", "0.5", "0.75", "1.0"], "Shares of rows kept.")
_VARIANTS = flags.DEFINE_list("variants", ["masked", "gather", "reduce", "blocks", "kernel",
                                           "dots"],
                              "Ways of reading the kept rows.")
_BLOCK = flags.DEFINE_integer("block", 32, "Rows per block of the blocks variant.")
_TOKENS = flags.DEFINE_integer("tokens", 256, "Tokens per timed scan.")
_REPEATS = flags.DEFINE_integer("repeats", 15, "Paired rounds (a dense scan and a variant's "
                                "each): the median ratio and its 95% interval.")
_COPIES = flags.DEFINE_integer("copies", 0, "Distinct copies of W cycled (0: from the cache).")
_CACHE_MULTIPLE = flags.DEFINE_float("cache_multiple", 4.0,
                                     "With --copies 0: the copies' bytes over the last-level cache.")
_OUT = flags.DEFINE_string("out", "results/benchmarks/sparse_rows.json", "JSON output.")
VARIANTS = ("masked", "gather", "reduce", "blocks", "kernel", "dots")


def reduce_rows(x_D, keep_D, W, n_buckets=8):
  """The kept rows' Σ x_i W_i as a multiply-reduce over gathered indices (no dot)."""
  d = x_D.shape[0]
  sizes = bucket_sizes(d, n_buckets)
  count = jnp.sum(keep_D, dtype=jnp.int32)

  def branch(size):
    def run():
      if size == d:
        return jnp.where(keep_D, x_D, 0) @ W
      idx = jnp.nonzero(keep_D, size=size, fill_value=0)[0]
      x_S = jnp.where(jnp.arange(size) < count, x_D[idx], 0)
      return jnp.sum(x_S[:, None] * W[idx], 0)
    return run
  return lax.switch(jnp.searchsorted(jnp.asarray(sizes), count), [branch(s) for s in sizes])


def block_rows(x_D, keep_D, W, block):
  """Σ over kept blocks of x_b W_b, each block a contiguous slice of W's rows."""
  n_blocks = x_D.shape[0] // block
  keep_B = jnp.any(keep_D.reshape(n_blocks, block), -1)
  order = jnp.nonzero(keep_B, size=n_blocks, fill_value=0)[0]

  def body(i, y):
    start = order[i] * block
    return y + lax.dynamic_slice_in_dim(x_D, start, block) @ \
        lax.dynamic_slice_in_dim(W, start, block, 0)
  return lax.fori_loop(0, jnp.sum(keep_B, dtype=jnp.int32), body,
                       jnp.zeros(W.shape[1], W.dtype))


def variant_step(name, block):
  if name == "masked":
    return lambda x, keep, W: jnp.where(keep, x, 0) @ W
  if name == "gather":
    return lambda x, keep, W: kept_rows_matmul_xla(x, keep, [W])[0]
  if name == "kernel":
    return lambda x, keep, W: cpu_kernels.kept_rows(x, keep, [W])[0]
  if name == "dots":
    return lambda x, keep, W: cpu_kernels.kept_dots(jnp.resize(x, W.shape[1]), keep, W)
  if name == "reduce":
    return reduce_rows
  return lambda x, keep, W: block_rows(x, keep, W, block)


def masks(rng, n, C, d, kept, block, blocked):
  """(n, C, d) keep masks with round(kept · d) rows per token; `blocked`: whole blocks."""
  if blocked:
    n_blocks = d // block
    chosen = rng.random((n, C, n_blocks)).argsort(-1) < round(kept * n_blocks)
    return np.repeat(chosen, block, -1)
  return rng.random((n, C, d)).argsort(-1) < round(kept * d)


def main(argv):
  del argv
  shapes = []
  for text in _SHAPES.value:
    try:
      d, o = (int(v) for v in text.split("x"))
    except ValueError:
      raise GSIError(f"--shapes takes dxO pairs such as 576x3072, got {text!r}") from None
    if d < 1 or o < 1:
      raise GSIError(f"--shapes: {text} must be positive")
    shapes.append((d, o))
  kept_shares = cli.numbers("kept", _KEPT.value, float)
  if any(not 0 < k <= 1 for k in kept_shares):
    raise GSIError(f"--kept takes shares in (0, 1], got {list(kept_shares)}")
  unknown = set(_VARIANTS.value) - set(VARIANTS)
  if unknown:
    raise GSIError(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
  block = experiment.positive("--block", _BLOCK.value)
  for d, _ in shapes:
    if "blocks" in _VARIANTS.value and d % block:
      raise GSIError(f"--block={block} does not divide d={d}; pick a divisor")
  if {"kernel", "dots"} & set(_VARIANTS.value) and not cpu_kernels.available():
    raise GSIError("--variants kernel and dots: the CPU kernel could not be built (see the "
                   "warning); install a C++ compiler or leave them out")
  experiment.positive("--tokens", _TOKENS.value)
  experiment.positive("--repeats", _REPEATS.value)
  experiment.finite("--copies (0: from the cache)", _COPIES.value, 0)
  experiment.finite("--cache_multiple", _CACHE_MULTIPLE.value, 0, 1024, low_open=True)
  out = experiment.check_output_path(_OUT.value)
  llc = last_level_cache_bytes()
  rng = np.random.default_rng(0)
  records = []
  for d, o in shapes:
    C = _COPIES.value or max(2, math.ceil(_CACHE_MULTIPLE.value * llc / (4 * d * o)))
    n = max(1, _TOKENS.value // C)
    Ws = [jax.random.normal(jax.random.key(c), (d, o), jnp.float32) / np.sqrt(d)
          for c in range(C)]
    x = jnp.asarray(rng.normal(size=(n, C, d)), jnp.float32)
    logging.info("%dx%d: %d copies (%.0f MB)", d, o, C, C * 4 * d * o / 1e6)
    dense = jax.jit(lambda x_NCD, Ws: scan_over_copies(lambda x, W: x @ W, x_NCD,
                                                       [(W,) for W in Ws]))
    for name in _VARIANTS.value:
      step = variant_step(name, block)
      run = jax.jit(lambda x_NCD, keep_NCD, Ws, step=step: scan_over_copies(
          lambda xk, W: step(xk[0], xk[1] > 0, W), jnp.stack([x_NCD, keep_NCD], 2),
          [(W,) for W in Ws]))
      for kept in kept_shares:
        keep = masks(rng, n, C, d, kept, block, name == "blocks")
        rows = float(keep.mean())
        keep = jnp.asarray(keep, jnp.float32)
        pair = timed_pair(lambda: dense(x, Ws).block_until_ready(),
                          lambda: run(x, keep, Ws).block_until_ready(), _REPEATS.value)
        dense_ms, ms = (1e3 * pair[key] / (n * C) for key in ("base_s", "other_s"))
        ideal = 1.0 if name == "masked" else 1 / rows
        rec = {"d": d, "d_out": o, "variant": name, "kept": kept, "rows_read": rows,
               "block": block if name == "blocks" else 1, "copies": C, "tokens": n * C,
               "dense_ms": dense_ms, "ms": ms, "measured_speedup": pair["ratio"],
               **interval_fields(pair), "ideal_speedup": ideal,
               "of_ideal": pair["ratio"] / ideal, "dense_gb_s": 4 * d * o / dense_ms / 1e6,
               "dense_compile_ms": 1e3 * pair["base_compile_s"],
               "compile_ms": 1e3 * pair["other_compile_s"]}
        records.append(rec)
        logging.info("%dx%d %s kept %.2f: %.4f ms (dense %.4f), %s of ideal %.2fx", d, o,
                     name, kept, ms, dense_ms,
                     ratio_text(pair["ratio"], pair["ratio_low"], pair["ratio_high"]), ideal)
  experiment.write_json(out, {"config": {"repeats": _REPEATS.value, "block": block,
                                         "last_level_cache_bytes": llc,
                                         "devices": str(jax.devices())}, "records": records})


if __name__ == "__main__":
  cli.run(main, one_process="times one map on one device")
