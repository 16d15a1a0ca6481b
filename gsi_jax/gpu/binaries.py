"""GPU binaries without a GPU: the Triton calls of an exported program compiled to sm_90
and gfx942, and what their binaries hold.

Triton itself (PyPI `triton`, which bundles ptxas and the AMDGPU backend) compiles a call's
Triton IR (`gsi_jax.gpu.programs.triton_calls`) to an sm_90 cubin or a gfx942 code object
on this CPU, whose registers, spills, shared memory, resident programs and main loops are
then readable.  Compiling proves less than running (`benchmarks/gpu_check.sh`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

import jax.numpy as jnp

from gsi_jax.errors import GSIError
from gsi_jax.gpu.programs import (ARCHES, GPTJ_SITES, LOWERING_K, TritonCall,
                                  gated_matmul_export, kept_exports, triton_calls)
from gsi_jax.models import params as P
from gsi_jax.ops import tiling


# Per SM of an H200 (sm_90): 64K registers, 228 KB shared memory (1 KB reserved per
# block), 64 warps, 32 blocks.  Registers are allocated per warp in units of 256.
SM90 = dict(registers=65536, shared=233472, reserved_shared=1024, warps=64, blocks=32)
GFX942_LDS = 65536  # MI300X: 64 KB of LDS per CU
GFX942_SIMDS = 4  # per CU; a program of num_warps waves spreads over them


@dataclasses.dataclass(frozen=True)
class Binary:
  """A compiled kernel's resources: registers per thread, spills, shared memory (bytes),
  the programs one SM or CU holds at once, and its `loop_profile`."""
  target: str
  registers: int
  spill_bytes: int  # local memory (sm_90) or scratch (gfx942): where spilled registers go
  shared_bytes: int
  programs_per_unit: int  # concurrent programs one SM (sm_90) or CU (gfx942) holds
  occupancy: int | None = None  # gfx942: waves per SIMD, as the compiler reports it
  loops: dict | None = None

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def _sm90_programs(registers: int, shared: int, warps: int) -> int:
  per_warp = -(-registers * 32 // 256) * 256
  by_registers = SM90["registers"] // max(per_warp * warps, 1)
  by_shared = SM90["shared"] // (shared + SM90["reserved_shared"])
  return min(by_registers, by_shared, SM90["warps"] // warps, SM90["blocks"])


def _pypi_ttir(ttir: str) -> str:
  """jax's Triton IR in the spelling PyPI's triton parses: jax's dialect prints a load's
  cache hint as `evictionPolicy = P`, triton 3.9 as a `cachePolicy` attribute."""
  return re.sub(r"(tt\.load [^:\n]*?) evictionPolicy = (\w+) :",
                r"\1 {cachePolicy = #tt.cache_policy<cache_modifier = none, "
                r"eviction_policy = \2>} :", ttir)


def _triton_stage(ttir: str, target, options: dict) -> str:
  """Run Triton's own TTIR passes (inlining, combining, loop unrolling) as XLA's pipeline does:
  `triton.compile` skips them for a source that is already TTIR."""
  from triton._C.libtriton import ir as tir
  from triton.backends.compiler import Language
  from triton.compiler.compiler import make_backend
  backend = make_backend(target)
  context = tir.context()
  tir.load_dialects(context)
  backend.load_dialects(context)
  with tempfile.NamedTemporaryFile("w", suffix=".ttir", delete=False) as f:
    f.write(_pypi_ttir(ttir))
  try:
    module = tir.parse_mlir_module(f.name, context)
  finally:
    os.unlink(f.name)
  module.context = context
  stages: dict = {}
  backend.add_stages(stages, backend.parse_options(options), Language.TRITON)
  return str(stages["ttir"](module, {}))


# The triton whose parser takes `_pypi_ttir`'s spelling of jax 0.10's Triton IR.  It lives
# apart from the venv (the Makefile's CPU_TRITON; PyPI's torch pins another triton).
CPU_TRITON_VERSION = "3.9.0"


def cpu_triton():
  """PyPI's triton at CPU_TRITON_VERSION, or one error line saying where it is."""
  where = ("`make test` installs it in .venv/cpu-triton; put that folder first on "
           "PYTHONPATH (PYTHONPATH=.venv/cpu-triton)")
  try:
    import triton
  except ImportError:
    raise GSIError(f"compiling GPU binaries on a CPU needs triton=={CPU_TRITON_VERSION}: "
                   f"{where}") from None
  if triton.__version__ != CPU_TRITON_VERSION:
    raise GSIError(f"compiling GPU binaries on a CPU needs triton=={CPU_TRITON_VERSION}, "
                   f"found {triton.__version__} at {os.path.dirname(triton.__file__)}: {where}")
  return triton


def compile_call(call: TritonCall, arch: str):
  """One kernel call's Triton IR compiled for "sm_90" (H100/H200) or "gfx942" (MI300X):
  Triton's compiled kernel (`.asm` holds the PTX, cubin or AMDGCN)."""
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said aloud
  triton = cpu_triton()
  from triton.backends.compiler import GPUTarget
  if arch == "sm_90":
    target = GPUTarget("cuda", 90, 32)
  elif arch == "gfx942":
    target = GPUTarget("hip", "gfx942", 64)
  else:
    raise ValueError(f"unknown GPU architecture {arch!r}; sm_90 or gfx942")
  options = {"num_warps": call.num_warps, "num_stages": call.num_stages}
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, f"{call.name}.ttir")
    with open(path, "w") as f:
      f.write(_triton_stage(call.ttir, target, options))
    return triton.compile(path, target=target, options=options)


def compile_binary(call: TritonCall, arch: str) -> Binary:
  """Compile one kernel call for "sm_90" or "gfx942", and read its binary's resources and
  its assembly's `loop_profile`."""
  triton = cpu_triton()
  compiled = compile_call(call, arch)
  loops = loop_profile(compiled.asm["ptx" if arch == "sm_90" else "amdgcn"], arch)
  with tempfile.TemporaryDirectory() as tmp:
    if arch == "sm_90":
      cubin = os.path.join(tmp, "kernel.cubin")
      with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
      tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                          "cuobjdump")
      usage = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True,
                             text=True, check=True).stdout
      fields = dict(re.findall(r"(REG|LOCAL|SHARED|STACK):(\d+)", usage))
      shared = int(fields["SHARED"]) + int(compiled.metadata.shared)
      registers = int(fields["REG"])
      return Binary(arch, registers, int(fields["LOCAL"]) + int(fields["STACK"]), shared,
                    programs_per_unit=_sm90_programs(registers, shared, call.num_warps),
                    loops=loops)
  asm = compiled.asm["amdgcn"]
  meta = lambda key: int(re.search(rf"\.{key}:\s+(\d+)", asm).group(1))
  occupancy = int(re.search(r"; Occupancy: (\d+)", asm).group(1))
  return Binary(arch, meta("vgpr_count"), meta("private_segment_fixed_size"),
                meta("group_segment_fixed_size") + int(compiled.metadata.shared),
                programs_per_unit=occupancy * GFX942_SIMDS // call.num_warps,
                occupancy=occupancy, loops=loops)


# What a compiled kernel's assembly does, by pattern: cross-lane shuffles and barriers (a
# reduction's steps), 16-byte global loads (to registers, or by cp.async to shared memory),
# all global loads to registers, and loads into shared memory that bypass registers (a
# load pipeline's).  sm_90: PTX, where a reduction shuffles with bfly, down or up
# (shfl.sync.idx broadcasts one lane's value, as a dot's addressing does, and is not
# counted); gfx942: AMDGCN, where a shuffle is a DPP move, a swizzle, a permute or a
# bpermute through LDS.
ASM_PATTERNS = {
    "sm_90": {
        "label": r"^(\$L__BB\d+_\d+):", "branch": r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+)",
        "shuffles": r"\bshfl\.sync\.(?:bfly|down|up)",
        "barriers": r"\bbar\.sync|\bbarrier\.sync",
        "loads_16B": r"\bld\.global[.\w:]*\.(?:v4\.(?:b32|u32|f32)|v2\.(?:b64|u64))"
                     r"|\bcp\.async\.c[ag]\.shared\.global[^,]*,[^,]*,\s*(?:0x10|16)\b",
        "loads": r"\bld\.global", "async_copies": r"\bcp\.async\.(?:ca|cg)"},
    "gfx942": {
        "label": r"^(\.LBB\d+_\d+):", "branch": r"\bs_c?branch\w*\s+(\.LBB\d+_\d+)",
        "shuffles": r"_dpp\b|\bds_swizzle|\bds_bpermute|\bds_permute|\bv_permlane",
        "barriers": r"\bs_barrier\b", "loads_16B": r"\b(?:global|buffer)_load_dwordx4\b",
        "loads": r"\b(?:global|buffer)_load_", "async_copies": r"\bbuffer_load_\w+ .*\blds\b"},
}


def loop_profile(asm: str, arch: str) -> dict:
  """Where a kernel's instructions sit: counts of ASM_PATTERNS inside its loops (from each
  label LLVM marks as a loop header to the last branch back to it) and in the whole
  kernel."""
  pats = ASM_PATTERNS[arch]
  lines = asm.splitlines()
  headers = {m.group(1): i for i, line in enumerate(lines)
             if (m := re.match(pats["label"], line.strip())) and "Loop Header" in line}
  latches = {}  # each loop header's last branch back to it
  for i, line in enumerate(lines):
    if (m := re.search(pats["branch"], line)) and headers.get(m.group(1), i) < i:
      latches[m.group(1)] = i
  inside = {i for label, last in latches.items() for i in range(headers[label], last + 1)}
  counts = lambda rows: {key: sum(bool(re.search(pats[key], lines[i])) for i in rows)
                         for key in ("shuffles", "barriers", "loads_16B", "loads",
                                     "async_copies")}
  return {"loops": len(latches), "in_loops": counts(sorted(inside)),
          "whole": counts(range(len(lines)))}


def _in_flight(lay: tiling.CallLayout, itemsize: int, platform: str, binary: Binary) -> dict:
  """A compiled call's weight bytes in flight per SM or CU, with the programs its binary
  holds resident, beside what Little's law needs there."""
  chip = tiling.CHIPS[platform]
  return {"in_flight_bytes_per_unit": tiling.bytes_in_flight(lay, itemsize, chip,
                                                             binary.programs_per_unit),
          "needed_bytes_per_unit": chip.needed_in_flight}


# Programs resident per SM or CU that every bf16 binary holds at least (the compiled
# binaries' own counts are in `plan_binaries`; tests/test_gpu_binaries.py).
RESIDENT_AT_LEAST = 2


def gptj_decode_bandwidth() -> list[dict]:
  """Each GPT-J site's decode tile on cuda and rocm, bf16: what it keeps in flight per SM or
  CU with RESIDENT_AT_LEAST programs at once, against what Little's law needs."""
  records = []
  for platform in ARCHES:
    chip = tiling.CHIPS[platform]
    for name, d, outs, m_cols in GPTJ_SITES:
      lay = tiling.layout(tiling.plan_for(platform, 1), 1, d, LOWERING_K, outs,
                          m_cols or 0)
      records.append({"platform": platform, "chip": chip.name, "site": name, "d": d,
                      "outs": list(outs), "block_o": lay.block_o, "block_d": lay.block_d,
                      "block_k": lay.block_k, "splits": lay.splits, "programs": lay.programs,
                      "in_flight_bytes_per_unit": tiling.bytes_in_flight(
                          lay, 2, chip, RESIDENT_AT_LEAST),
                      "needed_bytes_per_unit": chip.needed_in_flight})
  return records


# Calls that exercise each GPU tile plan, (tokens, d, k, out, w_transposed) per regime:
# GPT-J's attention input site (q, k, v and fc_in in one call), its fc_out (16384 rows),
# and GPT-2's tied head (50257 rows of the table: a masked last block; M padded to 50304
# columns); a batch of 2, 64 and a ragged 33 tokens; prefill past 64 tokens.
PLAN_CASES = {
    "decode": [(1, 4096, 256, (4096, 4096, 4096, 16384), False), (1, 16384, 256, 4096, False),
               (1, 768, 256, 50257, True)],
    "batch": [(2, 4096, 256, (4096, 4096, 4096, 16384), False), (64, 16384, 256, 4096, False),
              (33, 768, 256, 50257, True)],
    "prefill": [(65, 4096, 256, 4096, False), (2048, 4096, 256, 16384, False),
                (256, 768, 256, 50257, True)],
}


def plan_binaries(dtypes=("bfloat16", "float32"), progress=None) -> list[dict]:
  """Every GPU tile plan's PLAN_CASES compiled for its chip (cuda: sm_90, rocm: gfx942), in
  each dtype: the layout the call launches and the binary's resources, one record each."""
  records = []
  for platform, arch in ARCHES.items():
    for regime, cases in PLAN_CASES.items():
      for tokens, d, k, out, transposed in cases:
        for dtype in dtypes:
          plan = tiling.plan_for(platform, tokens)
          m_cols = P.head_m_columns(out) if transposed else None  # the head's padded M
          lay = tiling.layout(plan, tokens, d, k, out, m_cols or 0, jnp.dtype(dtype).itemsize)
          [call] = triton_calls(gated_matmul_export(platform, tokens, d, k, out,
                                                    jnp.dtype(dtype), transposed, m_cols))
          binary = compile_binary(call, arch)
          records.append({
              "platform": platform, "arch": arch, "regime": regime, "dtype": dtype,
              "tokens": tokens, "d": d, "k": k, "out": out if isinstance(out, int) else list(out),
              "w_transposed": transposed,
              "block_t": lay.block_t, "block_o": lay.block_o, "block_d": lay.block_d,
              "block_k": lay.block_k, "splits": lay.splits, "grid": list(lay.grid),
              "programs": lay.programs, "w_tile_elements": lay.block_d * lay.block_o,
              "num_warps": call.num_warps, "num_stages": call.num_stages,
              **_in_flight(lay, jnp.dtype(dtype).itemsize, platform, binary),
              **binary.as_dict()})
          if progress:
            progress(records[-1])
  return records


def kept_binaries(dtypes=("bfloat16", "float32"), progress=None) -> list[dict]:
  """The kept-rows and kept-dots kernels (`kept_exports`) at 1 and 16 tokens compiled for
  sm_90 and gfx942: grid and resources, one record each."""
  records = []
  for platform, arch in ARCHES.items():
    for tokens in (1, 16):
      for dtype in dtypes:
        for outs, exported in kept_exports(platform, jnp.dtype(dtype), tokens).items():
          [call] = triton_calls(exported)
          binary = compile_binary(call, arch)
          itemsize = jnp.dtype(dtype).itemsize
          lay = tiling.layout(tiling.plan_for(platform, tokens), tokens, 4096, 1, outs,
                              itemsize=itemsize)
          records.append({"kernel": "kept_rows" if len(outs) > 1 else "kept_dots",
                          "platform": platform, "arch": arch, "dtype": dtype, "tokens": tokens,
                          "outs": list(outs), "grid": list(call.grid),
                          "block_o": lay.block_o, "block_d": lay.block_d,
                          **_in_flight(lay, itemsize, platform, binary), **binary.as_dict()})
          if progress:
            progress(records[-1])
  return records
