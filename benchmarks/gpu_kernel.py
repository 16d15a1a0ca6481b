"""The gated kernel on one device: the read ceiling, correctness against HIGHEST references,
the kernel's calls timed beside dense at 1-16 tokens, a sweep of decode tiles, and the
kept-rows and kept-dots kernels beside dense.

  PYTHONPATH=. python3 benchmarks/gpu_kernel.py --parts smoke --out smoke.json
  PYTHONPATH=. python3 benchmarks/gpu_kernel.py --parts timing --out timing.json
  python benchmarks/gpu_kernel.py --dry --out /tmp/k.json      # small shapes, any device

Parts (benchmarks/gpu_check.sh runs them as bounded steps):
  smoke    devices and versions; whether one tiny profiler trace parses (a GPU's has a
           device stream: `trace_parses`; where it does not, gpu_check runs every later
           step with --notraces and says so); the device's read bandwidth: a sum over
           --ceiling_gib of float32 and a copy of it (read + write), each the median of
           --repeats by wall clock and, on a GPU, by the kernels' own device time from a
           trace; the largest is the ceiling every other figure is divided by (a nominal
           peak is not what a chip reaches);
  floor    the launch floor, per call of 64 dependent one-block calls (a Pallas kernel, an
           XLA fusion) unrolled in one jit, which XLA puts in one command buffer as it puts
           a decoded token's kernels (`command_buffers` says whether XLA_FLAGS turned them
           off for this process);
  correct  `gated_matmul` against `gated_matmul_reference` (Precision.HIGHEST) at --maps,
           k = --k: every case (float32 and bfloat16, 1, 16 and 256 tokens, all slow,
           mixed and all fast) or, with --correct_cases=representative, one bfloat16 case
           per map and regime (1 token slow and fast, 16 and 256 mixed): the largest error
           over the largest output, against kernel.TOLERANCE;
  timing   per call, at --tokens tokens and --fast_share shares of fast tokens, in
           bfloat16: a gated site as a model runs it, g = x V_k and the kernel (the gate
           decided per token before it; thresholds per token of ∞ or 0 set the share),
           one program of --inner rounds over copies of W, and of (V_k, M), that each
           exceed 4x --cache_mb (every call reads them from HBM); dense x @ W over the same
           copies in alternation, paired rounds, the median ratio and its interval
           (`benchmarking`), each side's device time per call where the device keeps
           events, and a byte ideal that counts V_k; the calls share x (a throughput), and
           an all-fast call is timed again as a chain of sites (`dependent`: each call's x
           waits for the whole output of the one before, split sum included: a latency);
  tiles    the same timing at 1 token, all slow and all fast, at the first map, for each
           --tiles decode plan (block_o x block_d x warps, the reduction split as the
           platform's decode plan splits it);
  kept     the kept-rows kernel (`kept_kernel.kept_rows`: sparsity's product) and the
           kept-dots kernel (`kept_kernel.kept_dots`: CATS' up projection, W stored (O, d))
           timed the same way at --tokens and --fast_share shares kept (each token keeps
           its own random share; a row is read when any token keeps it), beside dense
           x @ W, each with its error against its reference.
The JSON is written again after every row, so a run stopped by a time limit keeps what it
measured.
--dry: d = 256, O = 512, k = 32, 1 and 2 tokens, a 64 MiB ceiling, 4 copies and 2 tile
plans, where a flag does not say otherwise: the whole path in a minute on a CPU, where the
kernel runs interpreted (its times then mean nothing).
"""

import dataclasses
import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from gsi_jax import cli, experiment
from gsi_jax.measure.benchmarking import (LAUNCH_FLOOR_CALLS, LAUNCH_FLOOR_KINDS, chained_calls,
                                  device_event_seconds, interval_fields, median_seconds,
                                  ratio_text, read_ceiling, timed_pair)
from gsi_jax.errors import GSIError
from gsi_jax.ops import kept_kernel, kernel, tiling

PARTS = ("smoke", "floor", "correct", "timing", "tiles", "kept")
CORRECT_CASES = ("all", "representative")
_PARTS = flags.DEFINE_list("parts", list(PARTS), f"Which of {', '.join(PARTS)} to run.")
_MAPS = flags.DEFINE_list("maps", ["4096x16384", "4096x4096", "16384x4096"],
                          "Maps d x O (GPT-J's fc_in, q/k/v/o, fc_out).")
_K = flags.DEFINE_integer("k", 256, "Rank of M.")
_TOKENS = flags.DEFINE_list("tokens", ["1", "2", "4", "8", "16"], "Tokens per timed call.")
_SHARES = flags.DEFINE_list("fast_share", ["0", "0.5", "1"], "Shares of fast tokens timed.")
_TILES = flags.DEFINE_list("tiles", ["256x32x4", "256x64x4", "128x64x4", "512x16x4",
                                     "256x32x8"], "Decode plans swept: block_o x block_d x "
                           "warps (block_k = block_d; the platform's decode plan otherwise).")
_CEILING_GIB = flags.DEFINE_float("ceiling_gib", 2.0, "GiB read by the ceiling's sum.")
_CACHE_MB = flags.DEFINE_float("cache_mb", 60.0, "The device's last-level cache (H200: 60).")
_REPEATS = flags.DEFINE_integer("repeats", 30, "Timed rounds (ceiling: repeats).")
_INNER = flags.DEFINE_integer("inner", 8, "Passes over the copies inside one timed program.")
_CORRECT_CASES = flags.DEFINE_enum("correct_cases", "all", list(CORRECT_CASES),
                                   "The correct part's cases: every one, or one per map and "
                                   "regime.")
_TRACES = flags.DEFINE_bool("traces", True, "Device times from profiler traces (--notraces: "
                            "wall clock only, where traces do not parse).")
_DRY = flags.DEFINE_bool("dry", False, "Small shapes: the whole path in seconds, any device.")
_OUT = flags.DEFINE_string("out", None, "JSON output.")

DRY = dict(maps=["256x512"], k=32, tokens=["1", "2"], ceiling_gib=1 / 16, cache_mb=0.25,
           tiles=["32x128x4", "64x64x4"], repeats=3, inner=2)
CORRECT_TOKENS = (1, 16, 256)
CORRECT_SHARES = (0.0, 0.5, 1.0)
REPRESENTATIVE = ((1, 0.0), (1, 1.0), (16, 0.5), (256, 0.5))  # (tokens, fast share), bf16


@dataclasses.dataclass(frozen=True)
class KernelBenchConfig:
  parts: tuple[str, ...]
  maps: tuple[tuple[int, int], ...]
  k: int
  tokens: tuple[int, ...]
  fast_shares: tuple[float, ...]
  tiles: tuple[tuple[int, int, int], ...]
  ceiling_gib: float
  cache_mb: float
  repeats: int
  inner: int
  out: str
  correct_cases: str = "all"
  traces: bool = True

  def __post_init__(self):
    unknown = sorted(set(self.parts) - set(PARTS))
    if unknown or not self.parts:
      raise GSIError(f"--parts takes a list of {', '.join(PARTS)}, got {list(self.parts)}")
    for name in ("k", "repeats", "inner"):
      experiment.positive(f"--{name}", getattr(self, name))
    if any(t < 1 for t in self.tokens):
      raise GSIError(f"--tokens takes positive whole numbers, got {list(self.tokens)}")
    if any(not 0 <= f <= 1 for f in self.fast_shares):
      raise GSIError(f"--fast_share takes numbers in [0, 1], got {list(self.fast_shares)}")
    experiment.finite("--ceiling_gib", self.ceiling_gib, 0, 1024, low_open=True)
    experiment.finite("--cache_mb", self.cache_mb, 0, 2**20, low_open=True)
    if any(self.k > d for d, _ in self.maps):
      raise GSIError(f"--k ({self.k}) must not exceed a map's d ({list(self.maps)})")
    for bo, bd, warps in self.tiles:
      if min(bo, bd) < tiling.MIN_BLOCK or warps not in (1, 2, 4, 8, 16):
        raise GSIError(f"--tiles: {bo}x{bd}x{warps} needs blocks >= {tiling.MIN_BLOCK} and "
                       "warps a power of two up to 16")


def _pairs(flag: str, values, size: int) -> tuple[tuple[int, ...], ...]:
  out = []
  for v in values:
    numbers = experiment.whole_numbers(f"--{flag}", v)
    if len(numbers) != size:
      raise GSIError(f"--{flag}: {v!r} is not {size} positive whole numbers joined by x")
    out.append(numbers)
  return tuple(out)


def config_from_flags() -> KernelBenchConfig:
  pick = cli.preset_or_flag(DRY if _DRY.value else None)
  if not _OUT.value:
    raise GSIError("--out is required: the JSON this run writes")
  return KernelBenchConfig(
      parts=tuple(_PARTS.value), maps=_pairs("maps", pick("maps", _MAPS), 2),
      k=pick("k", _K), tokens=tuple(cli.numbers("tokens", pick("tokens", _TOKENS), int)),
      fast_shares=tuple(cli.numbers("fast_share", _SHARES.value, float)),
      tiles=_pairs("tiles", pick("tiles", _TILES), 3),
      ceiling_gib=pick("ceiling_gib", _CEILING_GIB), cache_mb=pick("cache_mb", _CACHE_MB),
      repeats=pick("repeats", _REPEATS), inner=pick("inner", _INNER), out=_OUT.value,
      correct_cases=_CORRECT_CASES.value, traces=_TRACES.value)


def device_platform() -> str:
  """cuda, rocm, tpu, or cpu (where the kernel runs the cuda plan interpreted)."""
  device = jax.devices()[0]
  if device.platform == "gpu":
    return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"
  return device.platform


def device_seconds(c: KernelBenchConfig, fn):
  """fn's device time per call from a trace (`device_event_seconds`), or None without
  traces (--notraces) or where the trace has no device stream."""
  return device_event_seconds(fn)["device_s"] if c.traces else None


def smoke(c: KernelBenchConfig) -> dict:
  """Devices and versions, whether a tiny trace parses, and the read ceiling."""
  tiny = jax.jit(lambda a: a + 1)
  x_8 = jnp.zeros((8,), jnp.float32)
  parses = device_event_seconds(lambda: tiny(x_8).block_until_ready())["device_s"] is not None
  logging.info("devices %s, jax %s; a tiny trace %s", jax.devices(), jax.__version__,
               "parses" if parses else "has no device stream: later steps time by wall clock")
  return {"jax_version": jax.__version__, "trace_parses": parses,
          "ceiling": {**read_ceiling(int(c.ceiling_gib * 2**30), c.repeats,
                                     traces=c.traces and parses), "repeats": c.repeats}}


def command_buffers_on() -> bool:
  """Whether XLA may put kernels in command buffers here: XLA_FLAGS turns them off with an
  empty --xla_gpu_enable_command_buffer=."""
  flags_set = os.environ.get("XLA_FLAGS", "").split()
  return "--xla_gpu_enable_command_buffer=" not in flags_set


def launch_floor(c: KernelBenchConfig) -> dict:
  """What a call costs when it does next to nothing, inside one command buffer as a
  decode's calls are: LAUNCH_FLOOR_CALLS dependent one-block calls (a Pallas kernel, and an
  XLA fusion) per call, by wall clock and by device events (`device_event_seconds`)."""
  x_8 = jnp.zeros((8,), jnp.float32)
  floor = {"calls": LAUNCH_FLOOR_CALLS}
  for kind in LAUNCH_FLOOR_KINDS:
    run = chained_calls(kind, interpret=device_platform() == "cpu")
    fn = lambda: run(x_8).block_until_ready()  # noqa: E731
    device_s = device_seconds(c, fn)
    floor[kind] = {
        "wall_us": 1e6 * median_seconds(fn, c.repeats) / LAUNCH_FLOOR_CALLS,
        "device_us": None if device_s is None else 1e6 * device_s / LAUNCH_FLOOR_CALLS}
  return {**floor, "command_buffers": command_buffers_on()}


def _problem(key, tokens: int, d: int, k: int, out: int, dtype, share: float):
  """x, g = x V_k, thresholds per token (∞: fast, 0: slow) that make `share` of them fast,
  M and W."""
  kx, kb, kw = jax.random.split(key, 3)
  x = jax.random.normal(kx, (tokens, d), jnp.float32).astype(dtype)
  V, M = _basis(kb, d, k, out, dtype)
  return x, x @ V, jnp.where(fast_tokens(tokens, share), jnp.inf, 0.0), M, _map(kw, d, out, dtype)


def _scaled(key, shape, dtype):
  """Random normal entries over the square root of the first dimension (a map's inputs)."""
  return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(shape[0])).astype(dtype)


def _basis(key, d: int, k: int, out: int, dtype):
  """A random V (d, k) and M (k, out)."""
  kv, km = jax.random.split(key)
  return _scaled(kv, (d, k), dtype), _scaled(km, (k, out), dtype)


def _map(key, d: int, out: int, dtype):
  """A random W (d, out)."""
  return _scaled(key, (d, out), dtype)


def fast_tokens(tokens: int, share: float) -> jax.Array:
  """round(share · tokens) fast tokens, spread over the call (alternating at 0.5)."""
  fast = round(share * tokens)
  return (jnp.arange(tokens) * fast) % tokens < fast if fast < tokens else \
      jnp.ones((tokens,), bool)


def correct_cases(c: KernelBenchConfig) -> list[tuple]:
  """(map, dtype, tokens, fast share) of every case the correct part checks."""
  if c.correct_cases == "representative":
    return [(m, jnp.bfloat16, t, f) for m in c.maps for t, f in REPRESENTATIVE]
  return [(m, dt, t, f) for m in c.maps for dt in (jnp.float32, jnp.bfloat16)
          for t in CORRECT_TOKENS for f in CORRECT_SHARES]


def correct(c: KernelBenchConfig):
  """Yields one case at a time: the kernel against its reference."""
  for (d, out), dtype, tokens, share in correct_cases(c):
    x, g, eps, M, W = _problem(jax.random.key(tokens), tokens, d, c.k, out, dtype, share)
    (y,), fast = kernel.gated_matmul(x, g, eps, [M], [W])
    (ref,), ref_fast = kernel.gated_matmul_reference(x, g, eps, [M], [W])
    error = kernel.relative_error(y, ref)
    tolerance = kernel.TOLERANCE[jnp.dtype(dtype)]
    same_gate = bool(jnp.array_equal(fast, ref_fast))
    yield {"d": d, "out": out, "k": c.k, "dtype": jnp.dtype(dtype).name,
           "tokens": tokens, "fast_share": float(jnp.mean(ref_fast)),
           "relative_error": error, "tolerance": tolerance, "same_gate": same_gate,
           "passed": error <= tolerance and same_gate}


def copies_for(c: KernelBenchConfig, n_bytes: int) -> int:
  """Distinct copies of arrays of n_bytes that together exceed 4x the cache (at least 2)."""
  return max(2, math.ceil(4 * c.cache_mb * 1e6 / n_bytes))


def _dense(x, *rest):
  """Dense x @ W, W the copy's last array."""
  return x @ rest[-1]


def _paired(c: KernelBenchConfig, fixed, copies, call, dense=_dense,
            dependent: bool = False) -> dict:
  """Paired rounds of call(*fixed, *copy) and dense(*fixed, *copy), each one program of
  c.inner passes over the same copies, and each one's device time per pass
  (`device_event_seconds`, None where the device keeps no events).  Independent calls
  share x, so XLA may run their work once and overlap them, and each reads 8 outputs: a
  throughput.  `dependent`: each call's x waits on the whole output of the call before
  (its sum, scaled to nothing, added to x), as a model's next site waits: a latency."""
  def passes(product):
    @jax.jit
    def run(fixed, copies):
      def body(_, acc):
        x, *rest = fixed
        for copy in copies:
          y = product(x, *rest, *copy).astype(jnp.float32)
          if dependent:
            total = jnp.sum(y)
            acc, x = acc + total, x + (total * 1e-30).astype(x.dtype)
          else:
            acc = acc + y[0, :8]
        return acc
      start = jnp.zeros((), jnp.float32) if dependent else jnp.zeros((8,), jnp.float32)
      return jax.lax.fori_loop(0, c.inner, body, start)
    return lambda: run(fixed, copies).block_until_ready()

  base, other = passes(dense), passes(call)
  pair = timed_pair(base, other, c.repeats)
  pair["base_device_s"] = device_seconds(c, base)
  pair["other_device_s"] = device_seconds(c, other)
  return pair


def _row(c: KernelBenchConfig, pair: dict, d: int, out: int, copies: int, kernel_bytes: float,
         **fields) -> dict:
  """One timed record: times per call (wall clock, and device events where the device keeps
  them), bandwidths, the byte ideal and the interval."""
  calls = c.inner * copies
  dense_s, kernel_s = pair["base_s"] / calls, pair["other_s"] / calls
  per_call_us = lambda key: None if pair[key] is None else 1e6 * pair[key] / calls
  dense_bytes = d * out * jnp.dtype(jnp.bfloat16).itemsize
  return {"d": d, "out": out, **fields, "dtype": "bfloat16", "copies": copies,
          "calls_per_round": calls, "dense_us": 1e6 * dense_s, "kernel_us": 1e6 * kernel_s,
          "dense_device_us": per_call_us("base_device_s"),
          "kernel_device_us": per_call_us("other_device_s"),
          "dense_gb_s": dense_bytes / dense_s / 1e9, "kernel_gb_s": kernel_bytes / kernel_s / 1e9,
          "kernel_weight_bytes": kernel_bytes, "dense_weight_bytes": dense_bytes,
          "byte_ideal_speedup": dense_bytes / kernel_bytes if kernel_bytes else None,
          "speedup": pair["ratio"], **interval_fields(pair),
          "compile_s": {"dense": pair["base_compile_s"], "kernel": pair["other_compile_s"]}}


def _timed_pair(c: KernelBenchConfig, d: int, out: int, tokens: int, share: float, plan=None,
                dependent: bool = False):
  """Paired rounds of a gated site's call, g = x V_k and the kernel, and dense x @ W
  (`dependent`: as a chain of sites, `_paired`).

  Every array a call reads is cache-cold: W in copies that together exceed 4x the
  cache, and (V, M) in copies of their own that do too; copy i takes W i mod its count
  and (V, M) i mod theirs, so each is read again only after 4 caches of others.  The
  byte ideal counts V_k, which every call reads for g."""
  dtype = jnp.dtype(jnp.bfloat16)
  fast = fast_tokens(tokens, share)
  w_copies = copies_for(c, d * out * dtype.itemsize)
  vm_copies = copies_for(c, (d + out) * c.k * dtype.itemsize)
  copies = max(w_copies if not bool(jnp.all(fast)) else 1,
               vm_copies if bool(jnp.any(fast)) else 1, 2)
  x, _, eps, _, _ = _problem(jax.random.key(0), tokens, d, c.k, out, dtype, share)
  bases = [_basis(jax.random.key(i), d, c.k, out, dtype) for i in range(min(vm_copies, copies))]
  maps = [_map(jax.random.key(i), d, out, dtype) for i in range(min(w_copies, copies))]
  copies_of = [(*bases[i % len(bases)], maps[i % len(maps)]) for i in range(copies)]
  platform = device_platform()
  if plan is None:
    call = kernel.gated_matmul
  else:
    on = "cuda" if platform == "cpu" else platform
    call = lambda *a: kernel.gated_matmul_on(on, *a, plan=plan, interpret=platform == "cpu")
  pair = _paired(c, (x, eps), copies_of,
                 lambda x, eps, V, M, W: call(x, x @ V, eps, [M], [W])[0][0],
                 dependent=dependent)
  lay = tiling.layout(plan or tiling.plan_for("cuda" if platform == "cpu" else platform, tokens),
                      tokens, d, c.k, out)
  kernel_bytes = (tiling.weight_elements_read(lay, np.asarray(fast)) + d * c.k) * dtype.itemsize
  return _row(c, pair, d, out, copies, kernel_bytes, k=c.k, tokens=tokens,
              fast_share=float(jnp.mean(fast)), v_bytes=d * c.k * dtype.itemsize,
              dependent=dependent)


def _timed_kept(c: KernelBenchConfig, d: int, out: int, tokens: int, share: float,
                dots: bool) -> dict:
  """Paired rounds of a kept kernel and dense x @ W over the same copies, and the kernel's
  error against its reference on the first copy.  dots: kept dots (keep over the O
  outputs, W stored (O, d)); else kept rows (keep over the d inputs, W stored (d, O))."""
  dtype = jnp.dtype(jnp.bfloat16)
  copies = copies_for(c, d * out * dtype.itemsize)
  kx, kk = jax.random.split(jax.random.key(tokens))
  x = jax.random.normal(kx, (tokens, d), jnp.float32).astype(dtype)
  keep = jax.random.uniform(kk, (tokens, out if dots else d)) < share
  Ws = [(jax.random.normal(jax.random.key(i), (out, d) if dots else (d, out), jnp.float32)
         / math.sqrt(d)).astype(dtype) for i in range(copies)]
  if dots:
    call, reference = kept_kernel.kept_dots, kept_kernel.kept_dots_reference
    dense = lambda x, keep, W: x @ W.T
  else:
    call = lambda x, keep, W: kept_kernel.kept_rows(x, keep, [W])[0]
    reference = lambda x, keep, W: kept_kernel.kept_rows_reference(x, keep, [W])[0]
    dense = _dense
  error = kernel.relative_error(call(x, keep, Ws[0]), reference(x, keep, Ws[0]))
  pair = _paired(c, (x, keep), [(W,) for W in Ws], call, dense)
  rows = int(jnp.sum(jnp.any(keep, axis=0)))  # read when any token keeps them
  return _row(c, pair, d, out, copies, rows * (d if dots else out) * dtype.itemsize,
              kernel="kept_dots" if dots else "kept_rows", tokens=tokens,
              keep_share=float(jnp.mean(keep)), rows_read=rows, relative_error=error,
              tolerance=kernel.TOLERANCE[dtype], passed=error <= kernel.TOLERANCE[dtype])


def timing(c: KernelBenchConfig):
  """Yields the kernel's calls beside dense, one map, token count and fast share at a time;
  an all-fast call also as a chain of dependent sites (`_paired`), whose whole output each
  next call waits for."""
  for d, out in c.maps:
    for tokens in c.tokens:
      for share in sorted({round(f * tokens) / tokens for f in c.fast_shares}):
        for dependent in (False, True) if share == 1 else (False,):
          r = _timed_pair(c, d, out, tokens, share, dependent=dependent)
          logging.info("d=%d O=%d %d tokens f=%.2f%s: kernel %.1f us (%.0f GB/s), dense "
                       "%.1f us, %s (byte ideal %.2fx)", d, out, tokens, r["fast_share"],
                       ", dependent" if dependent else "", r["kernel_us"], r["kernel_gb_s"],
                       r["dense_us"], ratio_text(r["speedup"], r["speedup_low"],
                                                 r["speedup_high"]), r["byte_ideal_speedup"])
          yield r


def tiles(c: KernelBenchConfig):
  """Yields each decode plan's call at 1 token, all slow and all fast."""
  d, out = c.maps[0]
  platform = {"cpu": "cuda"}.get(device_platform(), device_platform())
  for bo, bd, warps in c.tiles:
    plan = dataclasses.replace(tiling.plan_for(platform, 1), block_o=bo, block_d=bd,
                               block_k=bd, num_warps=warps)
    for share in (0.0, 1.0):
      row = _timed_pair(c, d, out, 1, share, plan)
      logging.info("tile %dx%dx%d f=%.0f: %.1f us, %.0f GB/s", bo, bd, warps, share,
                   row["kernel_us"], row["kernel_gb_s"])
      yield {"block_o": bo, "block_d": bd, "num_warps": warps, **row}


def kept(c: KernelBenchConfig):
  """Yields the kept-rows, then the kept-dots kernel beside dense at each token count and
  kept share."""
  d, out = c.maps[0]
  for dots in (False, True):
    for tokens in c.tokens:
      for share in c.fast_shares:
        r = _timed_kept(c, d, out, tokens, share, dots)
        logging.info("%s d=%d O=%d %d tokens, %.2f kept (%d rows read): %.1f us, dense "
                     "%.1f us, %s, error %.1e", r["kernel"], d, out, tokens,
                     r["keep_share"], r["rows_read"], r["kernel_us"], r["dense_us"],
                     ratio_text(r["speedup"], r["speedup_low"], r["speedup_high"]),
                     r["relative_error"])
        yield r


def run(c: KernelBenchConfig, save=lambda result: None) -> dict:
  """Every part of c.parts; save(result) after each row, so a stopped run keeps its rows."""
  result = {"platform": device_platform(), "devices": str(jax.devices()),
            "config": dataclasses.asdict(c), "traces": c.traces}
  if not c.traces:
    logging.info("--notraces: every time is by wall clock, device times are None")
  if "smoke" in c.parts:
    result.update(smoke(c))
    save(result)
  if "floor" in c.parts:
    result["launch_floor"] = launch_floor(c)
    save(result)
  for part, rows in (("correct", correct), ("timing", timing), ("tiles", tiles),
                     ("kept", kept)):
    if part in c.parts:
      result[part] = []
      for row in rows(c):
        result[part].append(row)
        save(result)
  if "correct" in result:
    logging.info("correct: %d of %d cases within tolerance",
                 sum(r["passed"] for r in result["correct"]), len(result["correct"]))
  return result


def main(argv):
  del argv
  c = config_from_flags()
  out = experiment.check_output_path(c.out)
  save = lambda result: experiment.write_json(out, result, partial=True)
  experiment.write_json(out, run(c, save))


if __name__ == "__main__":
  cli.run(main, one_process="times one kernel on one device")
