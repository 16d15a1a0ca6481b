"""What a decode launches on a GPU, read from XLA's own GPU compiler run on this CPU.

jaxlib 0.11.2's CUDA plugin (PyPI `jax-cuda13-pjrt`, `jax-cuda13-plugin`) loads without a
GPU.  A compile-only topology made from XLA's H200 target spec (`h200_target.txtpb`) then
lets `lower().compile()` run XLA's real GPU pipeline: fusion, Triton for the Pallas
kernels, thunk emission and the command-buffer (CUDA graph) conversion.  ptxas and
libdevice come from PyPI's `nvidia-cuda-nvcc` and `nvidia-nvvm`.  With `xla_dump_to`, each
program's `thunk_sequence_after_thunk_passes.txt` lists every kernel the GPU would launch,
and `launches` counts those of one decoded token (the body of `_generate`'s while loop).
GEMM autotuning is skipped: configurations change, kernel counts do not.  Compiled, not
run: a count is what the GPU would launch, not how long it takes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import os
import re
import sys

import jax
import jax.numpy as jnp

from gsi_jax.measure.benchmarking import chained_calls
from gsi_jax.errors import GSIError
from gsi_jax.gsi.transform import gsi_shapes
from gsi_jax.loading.load import param_shapes
from gsi_jax.models import ModelConfig
from gsi_jax.models import params as P
from gsi_jax.models.decoder import Decoder
from gsi_jax.models.model import _generate, decode_gate
from gsi_jax.ops import make_gate

TARGET_SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "h200_target.txtpb")
# What `make gpu-launches` installs beside the jax 0.11.2 environment (its own folder).
PLUGIN = ("jax-cuda13-pjrt==0.11.2", "jax-cuda13-plugin==0.11.2", "nvidia-cuda-nvcc==13.5.37",
          "nvidia-nvvm==13.5.37")
# Every decode program counted: the kernel methods at GPT-J-6B's shape, each with its gate,
# as benchmarks/gpu_decode.py times them (coin: each token fast with probability 0.9).
PROGRAMS = ("dense", "gsi_static", "gsi_coin", "gsi_gated", "gsi_eps0", "sparsity")
# Thunks that hold others or order them; every other thunk is work the GPU is given.
STRUCTURE = frozenset({"kCommandBuffer", "kWhile", "kConditional", "kSequential"})


def cuda_data_dir() -> str:
  """The folder holding bin/ptxas and nvvm/libdevice (PyPI's CUDA 13 toolkit wheels)."""
  for folder in sys.path:
    root = os.path.join(folder, "nvidia", "cu13")
    if os.path.isfile(os.path.join(root, "bin", "ptxas")) and glob.glob(
        os.path.join(root, "nvvm", "libdevice", "libdevice*.bc")):
      return root
  raise GSIError("no CUDA 13 ptxas and libdevice on the path: `make gpu-launches` installs "
                 f"{', '.join(PLUGIN)} into .venv-jax011/xla-gpu and puts it on PYTHONPATH")


def compile_only_mesh() -> jax.sharding.Mesh:
  """One compile-only H200 (no GPU needed), as a mesh of one device."""
  from jax.experimental import topologies
  if jax.__version__ != "0.11.2":
    raise GSIError(f"the deviceless GPU compile needs jax 0.11.2 (its CUDA plugin's), found "
                   f"{jax.__version__}: run it in .venv-jax011 (make gpu-launches)")
  try:
    with open(TARGET_SPEC, encoding="utf-8") as f:
      topology = topologies.get_topology_desc(platform="cuda", topology_name="h200",
                                              target_config=f.read(), topology="1x1x1")
  except Exception as e:  # the plugin's own error: not installed, or another version
    raise GSIError(f"jax's CUDA plugin did not load ({type(e).__name__}: {e}); `make "
                   "gpu-launches` installs it") from None
  return jax.sharding.Mesh(topology.devices[:1], ("x",))


@contextlib.contextmanager
def pallas_lowers_for_h200():
  """Pallas' Triton lowering asks the local GPU what it is; with none here, answer H200."""
  from jax._src.pallas.triton import gpu_info
  asked = gpu_info.get_gpu_info
  gpu_info.get_gpu_info = lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
  try:
    yield
  finally:
    gpu_info.get_gpu_info = asked


def program(config: ModelConfig, name: str, k: int = 256):
  """(parameter shapes, gate) of one decode program: GSI at rank k with random shapes of
  its own trees, sparsity with a threshold at every site."""
  dense = param_shapes(config, jnp.bfloat16)
  gate = lambda eps, mode="gated": make_gate(eps, mode, impl="auto", batch1_switch=True)
  if name == "dense":
    return dense, None
  if name == "sparsity":
    thresholds = {layer: dict.fromkeys(sites, 0.5)
                  for layer, sites in P.site_kernels(dense).items()}
    return P.with_site_values(dense, P.THRESHOLD, thresholds), gate(0.0)
  gates = {"gsi_static": gate(0.0, "static"), "gsi_coin": gate(0.9, "coin"),
           "gsi_gated": gate(0.1), "gsi_eps0": gate(0.0)}
  if name not in gates:
    raise GSIError(f"unknown program {name!r}; one of {', '.join(PROGRAMS)}")
  return gsi_shapes(dense, k), gates[name]


def compile_for_h200(fn, args, dump_dir: str):
  """Compile fn at args (shapes) for the compile-only H200, its thunks dumped in dump_dir."""
  replicated = jax.sharding.NamedSharding(compile_only_mesh(), jax.sharding.PartitionSpec())
  placed = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
                        args)
  with pallas_lowers_for_h200():
    lowered = jax.jit(fn).trace(*placed).lower()
  return lowered.compile(compiler_options={"xla_dump_to": dump_dir,
                                           "xla_gpu_cuda_data_dir": cuda_data_dir()})


def compile_generate(config: ModelConfig, name: str, batch: int, dump_dir: str,
                     prompt_len: int = 16, new_tokens: int = 32, k: int = 256):
  """Compile `_generate` of one program for the compile-only H200, its thunks dumped."""
  params, gate = program(config, name, k)
  gate = decode_gate(params, gate)  # as Model.generate decides it
  module = Decoder(config, jnp.bfloat16)
  args = (params, jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
          jax.ShapeDtypeStruct((), jnp.int32), gate, jax.ShapeDtypeStruct((0,), jnp.int32),
          jax.ShapeDtypeStruct((batch, new_tokens), jnp.int32))
  generate = lambda p, ids, n, g, eos, expected: _generate(module, p, ids, n, g, new_tokens,
                                                            eos, expected)
  return compile_for_h200(generate, args, dump_dir)


_THUNK = re.compile(r"^(\s*)\d+: (\w+)\s+\[[^\]]*\]\s*(\S*)")
_BRANCH = re.compile(r"^(\s*)(\w*branch\w*|case_\d+):\s*$")


def kernel_kind(name: str) -> str:
  """A launched kernel's kind, from the name XLA gives its fusion or Pallas gives its call."""
  base = re.sub(r"(_+\d+)+$", "", name)
  if base.startswith(("gsi_", "kept_", "cats_")):
    return "pallas"
  if "gemm" in base or "cublas" in base or base.startswith("triton_gemm"):
    return "gemm"
  if "reduce" in base or base.startswith("triton_softmax"):
    return "reduction"
  if base.startswith("wrapped_"):
    return "wrapped elementwise"
  return "copy" if base == "kCopy" else "elementwise"


@dataclasses.dataclass
class Launches:
  """One decoded token: kernels always run, each conditional's branches, by kind."""
  always: int
  conditionals: int
  branches: list[dict[str, int]]  # per conditional: {branch: kernels}
  command_buffers: int
  by_kind: dict[str, int]

  @property
  def largest(self) -> int:
    """Kernels a token launches taking the larger branch of every conditional."""
    return self.always + sum(max(b.values(), default=0) for b in self.branches)

  def as_dict(self) -> dict:
    return {"kernels": self.always, "kernels_with_larger_branches": self.largest,
            "conditionals": self.conditionals, "branch_kernels": self.branches,
            "command_buffers": self.command_buffers, "by_kind": self.by_kind}


def while_body_launches(text: str) -> Launches:
  """The thunks inside the program's (outermost) while body: one decoded token."""
  lines = text.splitlines()
  start = next((i for i, line in enumerate(lines) if line.strip() == "body:"), None)
  if start is None:
    raise GSIError("the program has no while loop: not a _generate program")
  body_indent = len(lines[start]) - len(lines[start].lstrip())
  always, by_kind = 0, collections.Counter()
  branches: list[dict[str, int]] = []
  buffers = 0
  frames: list[tuple[int, dict[str, int]]] = []  # open conditionals: (indent, branches)
  current: str | None = None
  for line in lines[start + 1:]:
    if not line.strip():
      continue
    indent = len(line) - len(line.lstrip())
    if indent <= body_indent:
      break
    while frames and indent <= frames[-1][0]:
      frames.pop()
      current = None
    branch = _BRANCH.match(line)
    if branch and frames:
      current = branch.group(2)
      frames[-1][1].setdefault(current, 0)
      continue
    thunk = _THUNK.match(line)
    if not thunk:
      continue
    kind, name = thunk.group(2), thunk.group(3)
    if kind == "kConditional":
      branches.append({})
      frames.append((indent, branches[-1]))
      current = None
      continue
    if kind == "kCommandBuffer":
      buffers += 1
    if kind in STRUCTURE:
      continue
    if frames and current is not None:
      frames[-1][1][current] += 1
    else:
      always += 1
    by_kind[kernel_kind(name or kind)] += 1
  return Launches(always, len(branches), branches, buffers, dict(sorted(by_kind.items())))


def command_buffers(text: str) -> tuple[list[list[str]], list[str]]:
  """(the kernels of each top-level command buffer, the kernels outside any) of a program
  without a loop: what a GPU runs as one CUDA graph each, and what it launches one by one."""
  buffers: list[list[str]] = []
  outside: list[str] = []
  for line in text.splitlines():
    thunk = _THUNK.match(line)
    if not thunk:
      continue
    indent, kind, name = len(thunk.group(1)), thunk.group(2), thunk.group(3)
    if kind == "kCommandBuffer" and indent == 0:
      buffers.append([])
    elif kind not in STRUCTURE:
      (buffers[-1] if indent > 0 and buffers else outside).append(name or kind)
  return buffers, outside


def launch_floor_buffers(kind: str, dump_dir: str) -> dict:
  """The launch floor's program (`benchmarking.chained_calls`) compiled for the H200: how
  many command buffers, the kernels in each and outside."""
  compile_for_h200(chained_calls(kind), (jax.ShapeDtypeStruct((8,), jnp.float32),), dump_dir)
  # After the thunk passes (the command-buffer conversion among them), where they ran.
  dumped = glob.glob(os.path.join(dump_dir, "*thunk_sequence_after_thunk_passes.txt")) or \
      glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt"))
  if len(dumped) != 1:
    raise GSIError(f"{dump_dir} holds {len(dumped)} thunk sequences, not one")
  with open(dumped[0], encoding="utf-8") as f:
    buffers, outside = command_buffers(f.read())
  return {"command_buffers": len(buffers), "kernels_in_buffers": [len(b) for b in buffers],
          "kernels_outside": len(outside)}


def dumped_launches(dump_dir: str) -> Launches:
  """The launches of the one _generate program dumped in dump_dir."""
  def text(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  looped = [t for t in map(text, glob.glob(os.path.join(
      dump_dir, "*thunk_sequence_after_thunk_passes.txt"))) if "body:" in t]
  if len(looped) != 1:
    raise GSIError(f"{dump_dir} holds {len(looped)} programs with a while loop, not one")
  return while_body_launches(looped[0])
