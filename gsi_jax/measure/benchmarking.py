"""How every benchmark measures: paired rounds and the median of their ratios with a
bootstrap interval, best-of-n wall time, a device's own kernel time from a profiler trace,
greedy decode tokens/s with compile time apart,
cache-cold scans over distinct weight copies, where a decode's time goes, the programs
JAX compiles, and peak resident memory of one phase of work."""

from __future__ import annotations

import glob
import gzip
import itertools
import json
import logging
import math
import os
import resource
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from gsi_jax.errors import GSIError


def alternating_rounds(fns, rounds: int):
  """(seconds[round][i], compile seconds[i]): each fn run once to compile and warm up,
  then all of them once per round, in turn.  A drift in the machine's speed reaches every
  fn of a round alike, so per-round ratios cancel it where best-of-n times do not."""
  if int(rounds) < 1:
    raise GSIError(f"timed repeats must be >= 1, got {rounds}")
  compile_s = [_seconds(fn) for fn in fns]
  return [[_seconds(fn) for fn in fns] for _ in range(rounds)], compile_s


# Fewer paired rounds than this give a ratio but no interval and no verdict: a bootstrap
# over one or two rounds is one or two numbers, not a spread (a one-round run once printed
# [4.252, 4.252] and was picked as the fastest method, from noise).
MIN_ROUNDS = 3
TOO_FEW_ROUNDS = "too few rounds"
# From this many rounds the interval of the median ratio covers it 95% of the time (the
# order-statistic interval needs 6: the range of n covers the median with probability
# 1 - 2 * 0.5**n, 97% at 6).  Below, the interval is the range of the rounds, said as such,
# with its own coverage and no verdict (75% at 3 rounds).
INTERVAL_ROUNDS = 6
RANGE_ONLY = "range only"


def ratio_interval(base_s, other_s, confidence: float = 0.95, resamples: int = 2000,
                   seed: int = 0) -> dict:
  """The speed of `other` over `base` (base time / other time) from paired rounds: the
  median of the per-round ratios, and an interval of that median: from INTERVAL_ROUNDS
  rounds a bootstrap one (rounds resampled with replacement), from MIN_ROUNDS the range of
  the rounds with the coverage it has, below none.  `base_spread` is the base's slowest
  round over its fastest, the noise every claim here sits in."""
  base, other = np.asarray(base_s, float), np.asarray(other_s, float)
  if base.shape != other.shape or base.ndim != 1 or not base.size:
    raise GSIError(f"paired rounds must be two equal non-empty lists, got {base.shape} "
                   f"and {other.shape}")
  ratios = base / other
  low = high = None
  if ratios.size >= INTERVAL_ROUNDS:
    draws = np.random.default_rng(seed).integers(0, ratios.size, (resamples, ratios.size))
    medians = np.median(ratios[draws], axis=1)
    tail = 100 * (1 - confidence) / 2
    low, high = (float(v) for v in np.percentile(medians, [tail, 100 - tail]))
    interval = "bootstrap"
  elif ratios.size >= MIN_ROUNDS:
    low, high = float(ratios.min()), float(ratios.max())
    confidence, interval = 1 - 2 * 0.5 ** ratios.size, f"range of {ratios.size} rounds"
  else:
    confidence, interval = None, None
  return {"ratio": float(np.median(ratios)), "ratio_low": low, "ratio_high": high,
          "confidence": confidence, "interval": interval, "rounds": int(ratios.size),
          "base_spread": float(base.max() / base.min())}


def timed_pair(base, other, rounds: int) -> dict:
  """base and other (callables that return once their work is done) in paired rounds:
  each one's median seconds and compile seconds, and other's speed over base with its
  interval (`ratio_interval`)."""
  return timed_beside_each(base, [other], rounds)[0]


def timed_beside_each(base, others, rounds: int) -> list[dict]:
  """`timed_pair`'s fields for each of others, all timed in the same rounds: base once a
  round, then each other in turn.  One base run a round serves them all, and each ratio
  is still taken within its round."""
  times, compile_s = alternating_rounds([base, *others], rounds)
  base_s, *others_s = (np.array(t) for t in zip(*times))
  return [{"base_s": float(np.median(base_s)), "other_s": float(np.median(other_s)),
           "base_compile_s": compile_s[0], "other_compile_s": other_compile,
           **ratio_interval(base_s, other_s)}
          for other_s, other_compile in zip(others_s, compile_s[1:])]


def interval_fields(pair: dict, prefix: str = "speedup") -> dict:
  """A record's fields for a timed pair's ratio: the median, its interval, the rounds and
  the base's spread."""
  return {f"{prefix}_low": pair["ratio_low"], f"{prefix}_high": pair["ratio_high"],
          "rounds": pair["rounds"], "dense_spread": pair["base_spread"],
          "verdict": verdict(pair)}


def verdict(interval: dict) -> str:
  """"faster", "slower", "within noise" where the interval holds 1.0; "too few rounds"
  where there is no interval, and "range only" where it is the range of too few rounds."""
  if interval["ratio_low"] is None:
    return TOO_FEW_ROUNDS
  if interval["rounds"] < INTERVAL_ROUNDS:
    return RANGE_ONLY
  if interval["ratio_low"] > 1:
    return "faster"
  if interval["ratio_high"] < 1:
    return "slower"
  return "within noise"


def ratio_text(ratio: float, low, high) -> str:
  """"1.23x [1.20, 1.25]", or "1.23x (too few rounds for an interval)" without one."""
  if low is None:
    return f"{ratio:.2f}x ({TOO_FEW_ROUNDS} for an interval)"
  return f"{ratio:.2f}x [{low:.2f}, {high:.2f}]"


def median_seconds(fn, repeats: int) -> float:
  """The median of `repeats` runs of fn, after one that compiles and warms up."""
  times, _ = alternating_rounds([fn], repeats)
  return float(np.median([t for t, in times]))


def read_ceiling(n_bytes: int, repeats: int, traces: bool = True) -> dict:
  """The device's read bandwidth, measured: a jitted sum over n_bytes of float32 and a copy
  of them (a read and a write), each the median of `repeats` by wall clock and, where the
  device records its own events (a GPU) and `traces`, by the kernels' device time
  (`device_event_seconds`); the largest is the ceiling (`ceiling_gb_s`, its
  `ceiling_source` naming which).  n_bytes must exceed the last-level cache several
  times, else the sum reads the cache."""
  n = int(n_bytes) // 4
  x = jnp.ones((n,), jnp.float32) + 0  # on the device, not a broadcast constant
  total, copy = jax.jit(jnp.sum), jax.jit(lambda a: a + 1)
  read = lambda: total(x).block_until_ready()
  write = lambda: copy(x).block_until_ready()
  rates = {"reduce_gb_s": 4 * n / median_seconds(read, repeats) / 1e9,
           "copy_gb_s": 2 * 4 * n / median_seconds(write, repeats) / 1e9}
  for name, fn, moved in (("reduce_device_gb_s", read, 4 * n),
                          ("copy_device_gb_s", write, 8 * n)):
    device_s = device_event_seconds(fn)["device_s"] if traces else None
    rates[name] = moved / device_s / 1e9 if device_s else None
  logging.info("read ceiling (GB/s): %s", ", ".join(
      f"{k[:-5]} {v:.1f}" for k, v in rates.items() if v is not None))
  source = max((k for k, v in rates.items() if v is not None), key=rates.get)
  return {"bytes": 4 * n, **rates, "ceiling_gb_s": rates[source], "ceiling_source": source}


# The launch floor's calls: one command buffer (CUDA graph) on a GPU, as a decode runs in
# one, where XLA's smallest is 5 kernels.
LAUNCH_FLOOR_CALLS = 64
LAUNCH_FLOOR_KINDS = ("pallas", "xla")


def _add_one(x_ref, o_ref):
  o_ref[...] = x_ref[...] + 1.0


def chained_calls(kind: str, calls: int = LAUNCH_FLOOR_CALLS, interpret: bool = False):
  """The launch floor's program, a function of 8 floats: `calls` dependent one-block calls,
  unrolled in one jit so that a GPU runs them as one command buffer, as it runs a decoded
  token's kernels (a loop would time a host launch and a loop condition per call instead).
  'pallas': a Pallas kernel that adds one; 'xla': an XLA fusion, with an optimization
  barrier after each so that no two fuse."""
  if kind == "pallas":
    from jax.experimental import pallas as pl
    step = pl.pallas_call(_add_one, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                          interpret=interpret, name="gsi_floor")
  elif kind == "xla":
    step = lambda x_8: jax.lax.optimization_barrier(x_8 * 1.000001 + 1.0)  # noqa: E731
  else:
    raise GSIError(f"unknown launch-floor kind {kind!r}; one of {', '.join(LAUNCH_FLOOR_KINDS)}")

  def run(x_8):
    for _ in range(calls):
      x_8 = step(x_8)
    return x_8
  return jax.jit(run)


def _traced(fn, runs: int, folder: str | None = None) -> tuple[list[dict], float]:
  """The events of a jax.profiler trace of `runs` calls of fn (compiled and warmed up
  outside it), written under `folder` (a temporary one by default), and the traced
  calls' wall seconds."""
  fn()
  folder = folder or tempfile.mkdtemp(prefix="gsi_jax_trace-")
  t0 = time.perf_counter()
  with jax.profiler.trace(folder):
    for _ in range(runs):
      fn()
  wall = time.perf_counter() - t0
  files = sorted(glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True))
  return (json.load(gzip.open(files[-1]))["traceEvents"] if files else []), wall


def device_event_seconds(fn, runs: int = 3) -> dict:
  """Time on the device per call of fn, from a jax.profiler trace of `runs` warm calls: the
  summed durations of the kernels on a device's stream timelines (CUPTI's records on a
  GPU), so neither the host nor the gaps between launches count; `kernels` per call by
  name, the largest first.  {"device_s": None} where the trace has no device stream (a
  CPU), so wall clock is all there is."""
  events, _ = _traced(fn, runs)
  meta = lambda kind: {(e.get("pid"), e.get("tid")): str(e.get("args", {}).get("name", ""))
                       for e in events if e.get("ph") == "M" and e.get("name") == kind}
  devices = {pid for (pid, _), name in meta("process_name").items()
             if name.startswith("/device:") and "CPU" not in name}
  streams = {key for key, name in meta("thread_name").items()
             if key[0] in devices and name.startswith("Stream")}
  by_name: dict[str, float] = {}
  for e in events:
    if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams:
      by_name[e["name"]] = by_name.get(e["name"], 0.0) + e.get("dur", 0) / 1e6 / runs
  if not by_name:
    return {"device_s": None, "kernels": {}}
  ranked = dict(sorted(by_name.items(), key=lambda item: -item[1])[:8])
  return {"device_s": sum(by_name.values()), "kernels": ranked}


def best_time(fn, repeats: int) -> float:
  return min(_seconds(fn) for _ in range(repeats))


def _decode(model, params, ids, n: int, gate):
  if int(n) < 1:
    raise GSIError(f"new tokens must be >= 1, got {n}")
  return lambda: jax.block_until_ready(model.generate(params, ids, n, gate, stop_at_eos=False))


def decode_tokens_per_s(model, params, ids, n: int, repeats: int, gate=None):
  """Tokens/s over exactly n new tokens (no stop at end-of-sequence), the median of
  `repeats` decodes after one that compiles, and the compile time."""
  times, (compile_s,) = alternating_rounds([_decode(model, params, ids, n, gate)], repeats)
  return n / float(np.median([t for t, in times])), compile_s


def decode_beside(model, ids, n: int, rounds: int, params, gate, base_params, base_gate=None):
  """params' greedy decode of n tokens beside the base's (dense, say) in paired rounds:
  the median tokens/s of each, params' compile time, and its speed over the base (the
  median of the per-round ratios) with a 95% interval (`interval_fields`)."""
  return decode_beside_each(model, ids, n, rounds, [(params, gate)], base_params, base_gate)[0]


def decode_beside_each(model, ids, n: int, rounds: int, trees_and_gates, base_params,
                       base_gate=None) -> list[dict]:
  """`decode_beside`'s fields for each (params, gate), all timed in the same rounds
  (`timed_beside_each`): one base decode a round serves them all."""
  pairs = timed_beside_each(_decode(model, base_params, ids, n, base_gate),
                            [_decode(model, params, ids, n, gate)
                             for params, gate in trees_and_gates], rounds)
  return [{"tokens_per_s": n / pair["other_s"], "dense_tokens_per_s": n / pair["base_s"],
           "measured_speedup": pair["ratio"], **interval_fields(pair),
           "compile_s": pair["other_compile_s"]} for pair in pairs]


def _seconds(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def last_level_cache_bytes() -> int:
  """The largest CPU cache this machine reports (32 MiB when unknown)."""
  sizes = []
  for i in range(8):
    try:
      with open(f"/sys/devices/system/cpu/cpu0/cache/index{i}/size") as f:
        value = f.read().strip()
    except OSError:
      continue
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(value[-1], 1)
    sizes.append(int(value.rstrip("KMG")) * scale)
  return max(sizes, default=32 * 2**20)


def available_memory_bytes() -> int:
  """Memory the kernel says can be had without swapping (MemAvailable; all of it when
  unknown): cache-cold copies sized from a large cache must still fit in it."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 2**10
  except OSError:
    pass
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def copies_plan(dims, itemsize: int, llc: int, available: int, copies: int = 0) -> dict:
  """{(d, O, k): copies of a gated map's (V_k, M, W)} over dims = (ds, Os, ks): `copies`
  (the caller's --copies), or enough that V and M alone exceed 4x the cache; at most what
  fits in a third of the free memory (two sets of copies are alive while the next shape's
  are made).  Checked for every shape before any is built."""
  plan = {}
  for d, d_out, k in itertools.product(*dims):
    per_copy = (d * k + k * d_out) * itemsize
    fits = available // (3 * (per_copy + d * d_out * itemsize))
    if copies > fits or fits < 2:
      raise GSIError(f"--copies: {max(copies, 2)} copies at d={d}, O={d_out}, k={k} need "
                     f"more than a third of the {available / 2**30:.1f} GiB free; pass --copies "
                     f"<= {fits} or smaller shapes")
    cold = max(2, math.ceil(4 * llc / per_copy))
    plan[d, d_out, k] = copies or min(cold, fits)
    if plan[d, d_out, k] < cold and not copies:
      logging.warning("d=%d O=%d k=%d: %d copies fit in memory, %d would exceed 4x the %.0f MB "
                      "cache; V and M cover %.1fx of it (v_and_m_over_cache)", d, d_out, k,
                      fits, cold, llc / 1e6, fits * per_copy / llc)
  return plan


def scan_over_copies(step, x_NCD, copies):
  """Token n*C + c goes through copy c: a scan over groups of C tokens, unrolled over copies
  (each copy is its own array, so no step slices or copies a weight)."""
  def body(carry, x_CD):
    return carry, jnp.stack([step(x_CD[c], *copy) for c, copy in enumerate(copies)])
  return jax.lax.scan(body, None, x_NCD)[1]


def peak_rss_mib() -> float:
  """Peak resident memory of the whole process so far, in MiB (Linux's ru_maxrss is KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_bytes(field: str = "VmRSS") -> int:
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise GSIError(f"/proc/self/status has no {field}")


# JAX's own compile events: a program traced and lowered (whether XLA then compiles it
# or the persistent compilation cache holds it), and XLA's compile of one.
LOWERED_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILED_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileEvents:
  """Programs JAX lowers inside a `with` block (each new function or shape; a program it
  has already built is not counted again), and the seconds spent lowering and compiling."""

  def __enter__(self):
    self.programs, self.seconds = 0, 0.0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)
    return self

  def _on_event(self, event: str, duration: float, **kwargs) -> None:
    del kwargs
    if event == LOWERED_EVENT:
      self.programs += 1
    if event in (LOWERED_EVENT, COMPILED_EVENT):
      self.seconds += duration

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._on_event)
    return False


class PeakMemory:
  """Peak resident memory inside a `with` block, in GB (Linux).

  Resets the kernel's high-water mark (clear_refs 5) on entry and reads VmHWM
  on exit; where the reset is refused, a thread samples VmRSS every 10 ms.
  """

  def __enter__(self):
    self.gb = None
    self._stop = None
    try:
      with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    except OSError:
      self._peak, self._stop = _rss_bytes(), threading.Event()
      self._thread = threading.Thread(target=self._sample, daemon=True)
      self._thread.start()
    return self

  def _sample(self):
    while not self._stop.wait(0.01):
      self._peak = max(self._peak, _rss_bytes())

  def __exit__(self, *exc):
    if self._stop is None:
      self.gb = _rss_bytes("VmHWM") / 1e9
    else:
      self._stop.set()
      self._thread.join()
      self.gb = max(self._peak, _rss_bytes()) / 1e9
    return False


TRACE_FLAG = "--xla_cpu_enable_xprof_traceme=true"  # per-op events on CPU; set before jax starts


def _is_op(name: str) -> bool:
  """Whether a trace event is an XLA op: not a Python frame, executor bookkeeping, a host
  call or a control-flow container (a cond, while or call, whose ops have events of their
  own)."""
  return not (name.startswith(("$", "end:", "while", "cond", "call"))
              or any(mark in name for mark in ("Thunk", "::", "(", " ")))


def _conditionals(events, n: int) -> dict:
  """The lax.cond and lax.switch containers per token, and their own milliseconds per token:
  each container's time less that of the ops it ran (the cost of choosing a branch)."""
  by_thread: dict = {}
  for e in events:
    by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
  count, own_us = 0, 0.0
  for thread in by_thread.values():
    thread.sort(key=lambda e: e["ts"])
    outer_end = -1.0  # a nested container's own time is already in its outer one's
    for i, e in enumerate(thread):
      if not e["name"].startswith("cond"):
        continue
      count += 1
      end = e["ts"] + e.get("dur", 0)
      if e["ts"] < outer_end:
        continue
      outer_end, inner = end, 0.0
      for op in thread[i + 1:]:
        if op["ts"] >= end:
          break
        inner += op.get("dur", 0) if _is_op(op["name"]) else 0.0
      own_us += e.get("dur", 0) - inner
  return {"conditionals_per_token": count / n, "conditional_own_ms_per_token": own_us / 1e3 / n}


def decode_profile(model, params, ids, n: int, gate=None, folder: str | None = None,
                   top: int = 12) -> dict:
  """Where a decode's time goes, from a jax.profiler trace of one warm greedy decode of n
  tokens: milliseconds per token in matrix products (XLA ops whose name holds "dot"),
  in custom and FFI calls (the CPU kernels) and in everything else, the ops run per token, and
  the `top` op kinds by time (an op's name without its numeric suffix), and the
  conditionals run per token with the time they take beyond their ops.

  On CPU, per-op events need XLA_FLAGS to hold TRACE_FLAG before jax starts; without
  them the counts are empty and the result says so.
  """
  run = lambda: jax.block_until_ready(model.generate(params, ids, n, gate, stop_at_eos=False))
  events, wall = _traced(run, 1, folder)
  events = [e for e in events if e.get("ph") == "X"]
  by_kind: dict[str, list[float]] = {}
  for e in events:
    if not _is_op(e["name"]):
      continue
    kind = e["name"].rstrip("0123456789").rstrip(".")
    entry = by_kind.setdefault(kind, [0.0, 0])
    entry[0] += e.get("dur", 0)
    entry[1] += 1
  per_token = lambda us: us / 1e3 / n
  part = lambda test: per_token(sum(t for k, (t, _) in by_kind.items() if test(k)))
  custom = lambda k: "custom" in k or "ffi" in k
  ranked = sorted(by_kind.items(), key=lambda item: -item[1][0])[:top]
  ops = sum(c for _, c in by_kind.values())
  return {"wall_ms_per_token": 1e3 * wall / n,
          "dot_ms_per_token": part(lambda k: "dot" in k and not custom(k)),
          "custom_call_ms_per_token": part(custom),
          "other_ms_per_token": part(lambda k: "dot" not in k and not custom(k)),
          "ops_per_token": ops / n, "per_op_events": bool(ops),
          **_conditionals(events, n),
          "top_ops": [{"op": k, "ms_per_token": per_token(t), "per_token": c / n}
                      for k, (t, c) in ranked]}
