"""The CPU kernels of the sparse batch-1 products, compiled on first use and called
through XLA's FFI.

`csrc/kept_rows.cc` streams only the kept rows of W, in place: for the kept-rows
product (magnitude sparsity; every map of a site in one call, split over a helper thread
when large) and for the kept dots (CATS' up_proj).  It is compiled
with the machine's C++ compiler against the headers jaxlib ships
(`jax.ffi.include_dir()`), once per source, jaxlib and CPU, into
$GSI_JAX_CACHE/kernels (default ~/.cache/gsi_jax/kernels), written to a temporary
file and renamed so that concurrent processes never load a partial library.
Where no compiler is found or the build fails, `available()` is False, one
warning says why, and callers fall back to XLA's gather.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "kept_rows.cc")
TARGET, DOTS_TARGET = "gsi_jax_kept_rows", "gsi_jax_kept_dots"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
_state: dict = {}


def cache_dir() -> str:
  root = os.environ.get("GSI_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                         "gsi_jax")
  return os.path.join(root, "kernels")


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      return next((line for line in f if line.startswith("model name")), platform.processor())
  except OSError:
    return platform.processor()


def _build() -> str:
  """The compiled library's path, building it if this source, jaxlib and CPU have none."""
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    raise OSError("no C++ compiler (g++ or c++) on PATH; set CXX")
  with open(SOURCE, "rb") as f:
    source = f.read()
  key = hashlib.sha256(b"\0".join([source, jax.__version__.encode(), " ".join(FLAGS).encode(),
                                   _cpu_model().encode(), compiler.encode()])).hexdigest()[:16]
  path = os.path.join(cache_dir(), f"kept_rows-{key}.so")
  if os.path.exists(path):
    return path
  os.makedirs(cache_dir(), exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
  os.close(fd)
  try:
    proc = subprocess.run([compiler, *FLAGS, "-I", jax.ffi.include_dir(), SOURCE, "-o", tmp],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
      raise OSError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def available() -> bool:
  """Whether the kernel is built and registered with XLA for cpu (tried once a process)."""
  if "ok" not in _state:
    try:
      library = ctypes.cdll.LoadLibrary(_build())
      jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.KeptRows), platform="cpu")
      jax.ffi.register_ffi_target(DOTS_TARGET, jax.ffi.pycapsule(library.KeptDots),
                                  platform="cpu")
      _state["ok"] = True
    except (OSError, subprocess.SubprocessError) as e:
      logging.warning("the kept-rows CPU kernel could not be built (%s); sparse decode on CPU "
                      "falls back to XLA's gather, which copies the kept rows", e)
      _state["ok"] = False
  return _state["ok"]


def kept_rows(x_D: jax.Array, keep_D: jax.Array, Ws) -> list[jax.Array]:
  """Σ_{i kept} x_i W_i for float32 x (d,) and each W (d, O) of a site: one FFI call that
  finds the kept rows once and streams them from every W (cpu only)."""
  shapes = [jax.ShapeDtypeStruct((W.shape[1],), jnp.float32) for W in Ws]
  return list(jax.ffi.ffi_call(TARGET, shapes)(x_D, keep_D, *Ws))


def kept_dots(x_D: jax.Array, keep_O: jax.Array, W_OD: jax.Array) -> jax.Array:
  """W_o · x for kept o, else 0, for float32 x (d,) and W (O, d): the FFI call (cpu only)."""
  return jax.ffi.ffi_call(DOTS_TARGET, jax.ShapeDtypeStruct((W_OD.shape[0],), jnp.float32))(
      x_D, keep_O, W_OD)
