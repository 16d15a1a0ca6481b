"""Every registered method's model exported for a GPU, as `pareto.py` builds it: the first
point of each method on a real model, its forward and its decode step lowered for cuda and
rocm (`gsi_jax.gpu.programs.model_programs`), with the kernel calls and CPU-only calls each makes.

The gate is the one a record decodes with (`evaluate.batch1`, impl "auto" unless the
experiment's --impl says otherwise), so each fast path takes its kernel where the program
is lowered for a GPU.  A method whose fast path is a Pallas kernel on cuda (`Method.fast_path`) must
call it once or more per site it rewrites; svd and the rank ladder read fewer bytes through
XLA's own products, so they call none.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

import jax

from gsi_jax.gpu import programs as gpu_programs
from gsi_jax.methods import registry
from gsi_jax.methods.evaluate import batch1
from gsi_jax.models import params as P

PHASES = {"forward": "forward", "decode_step": "decode"}  # model_programs' name: file's
FAST_KEYS = (P.V, P.THRESHOLD, P.CATS_THRESHOLD)  # a site holding one reads fewer bytes


def first_points(ctx) -> Iterator[tuple[str, registry.Point | None]]:
  """("dense", None), then (method, its first point) for every method this run evaluates."""
  yield "dense", None
  for name, method in registry.REGISTRY.items():
    if ctx.runs(name) and method.runs_on(ctx.grid, ctx.model.config):
      point = next(iter(method.points(ctx)), None)
      if point is None:
        raise method.no_points()
      yield name, point


def fast_sites(params) -> int:
  """Sites (the gated LM head included) that a fast path serves: those holding a basis,
  a magnitude threshold or CATS' threshold."""
  sites = [params[layer][site] for layer, site, _, _ in P.site_shapes(params)]
  head = params.get(P.LM_HEAD, {})
  return sum(any(key in node for key in FAST_KEYS) for node in [*sites, head])


def expects_kernel(name: str) -> bool:
  return name != "dense" and "Pallas kernel" in registry.REGISTRY[name].fast_path["cuda"]


def export_methods(ctx, out_dir: str, platforms=("cuda", "rocm"),
                   progress: Callable[[dict], None] = lambda row: None) -> list[dict]:
  """Writes out_dir/<method>-<platform>-<phase>.mlir (StableHLO text) for dense and every
  method's first point; returns a row per program: its file, kernel calls, the sites its
  fast path serves, and its CPU-only calls (FFI, LAPACK, host callbacks)."""
  os.makedirs(out_dir, exist_ok=True)
  rows = []
  for name, point in first_points(ctx):
    params = ctx.base if point is None else point.params
    gate = batch1(None if point is None else point.gate)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    sites = 0 if point is None else fast_sites(params)
    for platform in platforms:
      exports = gpu_programs.model_programs(ctx.model.config, platform, params=abstract,
                                            gate=gate)
      for phase, exported in exports.items():
        path = os.path.join(out_dir, f"{name}-{platform}-{PHASES[phase]}.mlir")
        with open(path, "w", encoding="utf-8") as f:
          f.write(exported.mlir_module())
        row = {"method": name, "knob": None if point is None else point.knob,
               "platform": platform, "phase": PHASES[phase], "file": os.path.basename(path),
               "kernel_calls": gpu_programs.kernel_calls(exported, platform),
               "fast_sites": sites, "expects_kernel": expects_kernel(name),
               "cpu_only_calls": gpu_programs.foreign_calls(exported, platform),
               "interpreter_loops": gpu_programs.interpreter_loops(exported)}
        row["passed"] = (row["cpu_only_calls"] == [] and row["interpreter_loops"] == 0 and
                         (row["kernel_calls"] >= sites if row["expects_kernel"]
                          else row["kernel_calls"] == 0))
        rows.append(row)
        progress(row)
  return rows
