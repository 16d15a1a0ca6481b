"""Where a result came from: the machine, the versions and the run's wall time, written
into every result JSON (`experiment.write_json`), so that no figure needs a log or a
memory of which machine ran it."""

from __future__ import annotations

import os
import platform
import time

import jax

from gsi_jax.measure.benchmarking import last_level_cache_bytes

_IMPORTED_AT = time.monotonic()


def cpu_model() -> str:
  """The CPU's model name as Linux reports it (the processor string elsewhere)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def process_wall_s() -> float:
  """Seconds since this process started (Linux), else since this module was imported."""
  try:
    with open("/proc/self/stat", encoding="ascii") as f:
      start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    with open("/proc/uptime", encoding="ascii") as f:
      uptime_s = float(f.read().split()[0])
    return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return time.monotonic() - _IMPORTED_AT


def process_cpu_s() -> float:
  """User plus system CPU seconds of this process, all its threads, so far."""
  t = os.times()
  return t.user + t.system


def device_text() -> str:
  """What this run computes on, for its first log line: "gpu: 1 x NVIDIA H200"."""
  kinds = sorted({d.device_kind for d in jax.devices()})
  return f"{jax.default_backend()}: {jax.device_count()} x {', '.join(kinds)}"


def run_record() -> dict:
  """The `run` field of a result JSON.  wall_s runs from the process's start to the write;
  cpu_s is the CPU time it used meanwhile (cpu_s / wall_s: the cores it kept busy)."""
  return {"wall_s": process_wall_s(), "cpu_s": process_cpu_s(), "cpu": cpu_model(),
          "cpus": os.cpu_count(),
          "last_level_cache_bytes": last_level_cache_bytes(),
          "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
          "backend": jax.default_backend(), "devices": device_text(), "jax": jax.__version__,
          "python": platform.python_version()}
