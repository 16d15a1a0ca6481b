"""GPU programs without a GPU: export for a platform and read what it calls.

`jax.export` lowers a jitted function for a platform that is not present, so a
`pallas_call` goes through that platform's real lowering here: Triton IR on cuda and rocm,
Mosaic on tpu.  The Triton IR travels inside the exported module (the
`__gpu$xla.gpu.triton` custom call's backend config); `gsi_jax.gpu.binaries` compiles it.
Lowering proves less than running: numerics and speed need a GPU
(`benchmarks/gpu_check.sh`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from jax import export
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir

from gsi_jax.errors import GSIError
from gsi_jax.gsi.transform import gsi_shapes, site_rank
from gsi_jax.loading.load import param_shapes
from gsi_jax.models import ModelConfig
from gsi_jax.models import params as P
from gsi_jax.models.decoder import Decoder, init_cache
from gsi_jax.ops import GatedWeights, gated_linear, kept_kernel, kernel, make_gate, tiling
TRITON_CALL = "__gpu$xla.gpu.triton"  # jaxlib <= 0.10.2: carries the Triton IR
TRITON_COMPILED_CALL = "triton_kernel_call_ffi"  # newer jaxlib: a kernel compiled at lowering
KERNEL_TARGETS = {"cuda": (TRITON_CALL, TRITON_COMPILED_CALL),
                  "rocm": (TRITON_CALL, TRITON_COMPILED_CALL), "tpu": ("tpu_custom_call",)}
# Custom calls a GPU program may hold besides our kernel: cuSOLVER/hipSOLVER eigensolvers and
# factorisations (LOBPCG), cuBLAS, and XLA's own sharding markers.
GPU_LIBRARY_CALL = re.compile(r"^(cu|hip)solver_|^(cu|hip)blas|^Sharding$|"
                              r"^SPMD(FullToShard|ShardToFull)Shape$")
HOST_CALLBACK = re.compile(r"callback", re.IGNORECASE)


# The GPU a program is exported for where lowering must name one: jaxlib >= 0.11 compiles
# the Triton kernel while lowering, for a device's compute capability, and with no GPU
# present it takes the device from the context's abstract mesh.  An H200 and an MI300X.
ARCHES = {"cuda": "sm_90", "rocm": "gfx942"}  # the GPU platforms and the chips compiled for
TARGET_DEVICES = {"cuda": jax.sharding.AbstractDevice("NVIDIA H200", 132, "cuda"),
                  "rocm": jax.sharding.AbstractDevice("gfx942", 304, "rocm")}


def export_for(fn, args, platform: str) -> export.Exported:
  """`fn` (jitted) exported for `platform`, as for TARGET_DEVICES' GPU; only our own
  kernel's custom-call check is off."""
  disabled = [export.DisabledSafetyCheck.custom_call(t) for t in KERNEL_TARGETS.get(platform, ())
              if t != "tpu_custom_call"]  # Mosaic's call is on export's stable list already
  exporting = export.export(fn, platforms=[platform], disabled_checks=disabled)
  if platform not in TARGET_DEVICES:
    return exporting(*args)
  target = jax.sharding.AbstractMesh((1,), ("target",), (jax.sharding.AxisType.Auto,),
                                     abstract_device=TARGET_DEVICES[platform])
  with jax.sharding.use_abstract_mesh(target):
    return exporting(*args)


_last_text: dict[bytes, str] = {}


def _text(exported: export.Exported) -> str:
  """The program as StableHLO text; the checks below each read it, so the last one is kept."""
  key = exported.mlir_module_serialized
  if key not in _last_text:
    _last_text.clear()
    _last_text[key] = exported.mlir_module()
  return _last_text[key]


def _custom_calls(exported: export.Exported) -> tuple:
  """Every custom call the exported program makes, as (target, backend config), once per
  call: a function called n times (a jitted op used by every layer) counts n times."""
  return _calls_in(_text(exported))


@functools.lru_cache(maxsize=1)
def _calls_in(text: str) -> tuple:
  with jax_mlir.make_ir_context(), ir.Location.unknown():
    module = ir.Module.parse(text)
    functions = {ir.StringAttr(op.attributes["sym_name"]).value: op
                 for op in module.body.operations if op.operation.name == "func.func"}

    def walk(op, found):
      for region in op.regions:
        for block in region.blocks:
          for child in block.operations:
            name, attrs = child.operation.name, child.operation.attributes
            if name == "stablehlo.custom_call":
              config = attrs["mhlo.backend_config"] if "mhlo.backend_config" in attrs else None
              found.append((ir.StringAttr(attrs["call_target_name"]).value, _plain(config)))
            elif name == "func.call":
              walk(functions[ir.FlatSymbolRefAttr(attrs["callee"]).value].operation, found)
            walk(child.operation, found)
      return found
    return tuple(walk(functions["main"].operation, []))


def _plain(config):
  """A backend config DictAttr as {name: int | str | bytes}, read while its context lives."""
  if not isinstance(config, ir.DictAttr):
    return {}
  out = {}
  for named in config:
    attr = named.attr
    if isinstance(attr, ir.IntegerAttr):
      out[named.name] = attr.value
    elif isinstance(attr, ir.StringAttr):
      out[named.name] = attr.value_bytes
  return out


def custom_call_targets(exported: export.Exported) -> collections.Counter:
  return collections.Counter(target for target, _ in _custom_calls(exported))


def kernel_calls(exported: export.Exported, platform: str) -> int:
  """Calls of the compiled gated-matmul kernel (its platform's custom call)."""
  targets = custom_call_targets(exported)
  return sum(targets[t] for t in KERNEL_TARGETS[platform])


def interpreter_loops(exported: export.Exported) -> int:
  """While loops in the program: a kernel in interpret mode is one (a loop over its grid)."""
  return _text(exported).count("stablehlo.while")


def foreign_calls(exported: export.Exported, platform: str) -> list[str]:
  """Custom calls that are neither our kernel nor a GPU library: host callbacks, CPU LAPACK."""
  ours = KERNEL_TARGETS.get(platform, ())
  return sorted({t for t in custom_call_targets(exported)
                 if t not in ours and not GPU_LIBRARY_CALL.search(t)})


def has_float64(exported: export.Exported) -> bool:
  return bool(re.search(r"\bf64\b", _text(exported)))


def has_host_callback(exported: export.Exported) -> bool:
  return any(HOST_CALLBACK.search(t) for t in custom_call_targets(exported))


@dataclasses.dataclass(frozen=True)
class TritonCall:
  """One compiled-kernel call of an exported GPU module."""
  name: str
  grid: tuple[int, int, int]
  num_warps: int
  num_stages: int
  ttir: str  # Triton IR, as text


def triton_calls(exported: export.Exported) -> list[TritonCall]:
  """The Triton kernels an exported cuda or rocm program calls, with their Triton IR."""
  from jax._src.pallas.triton import lowering as triton_lowering
  calls = []
  for target, config in _custom_calls(exported):
    if target != TRITON_CALL:
      continue
    with triton_lowering._new_ir_context(), ir.Location.unknown():
      text = str(ir.Module.parse(config["ir"]))
    calls.append(TritonCall(config["name"].decode(),
                            (config["grid_x"], config["grid_y"], config["grid_z"]),
                            config["num_warps"], config["num_stages"], text))
  return calls


def gated_matmul_export(platform: str, tokens: int, d: int, k: int, out, dtype,
                        w_transposed: bool = False, m_cols=None) -> export.Exported:
  """The kernel `ops.gated_matmul` runs on `platform` (`gated_matmul_on`, without the
  platform dispatch around it), on abstract arguments of one site's shapes, exported.
  out: one map's outputs or a sequence, one per map of the site; m_cols: M's stored
  columns when padded past out (a GSI LM head's)."""
  arg = jax.ShapeDtypeStruct
  outs = (out,) if isinstance(out, int) else tuple(out)
  Ms = tuple(arg((k, m_cols or o), dtype) for o in outs)
  Ws = tuple(arg((o, d) if w_transposed else (d, o), dtype) for o in outs)
  args = (arg((tokens, d), dtype), arg((tokens, k), dtype), arg((), jnp.float32), Ms, Ws)
  fn = jax.jit(lambda *a: kernel.gated_matmul_on(platform, *a, w_transposed=w_transposed))
  return export_for(fn, args, platform)


# Ops XLA runs without a kernel of their own: shape changes, constants, and the platform
# switch of `lax.platform_dependent` (a case on a constant index, which XLA folds away).
FREE_OPS = frozenset({"stablehlo.reshape", "stablehlo.constant", "stablehlo.case",
                      "stablehlo.return", "func.call", "func.return"})
LAUNCH_OPS = frozenset({"stablehlo.custom_call", "stablehlo.dot_general"})


def op_counts(exported: export.Exported) -> collections.Counter:
  """How many times each StableHLO op appears in the exported program's text."""
  return collections.Counter(re.findall(r"\b(stablehlo\.[a-z_]+|func\.call|func\.return)\b",
                                        _text(exported)))


def site_launches(exported: export.Exported) -> tuple[int, dict[str, int]]:
  """(launches, other ops) of a gated site's program: its kernel calls and products each
  launch, counted in the program's text, so both branches of a conditional count (a call
  runs one); any other op that is not free (`FREE_OPS`) would be fused or launched by XLA
  as it sees fit, so the count is exact only when there are none."""
  ops = op_counts(exported)
  others = {op: n for op, n in ops.items() if op not in FREE_OPS | LAUNCH_OPS}
  return sum(ops[op] for op in LAUNCH_OPS), others


def site_export(platform: str, tokens: int, d: int, outs, dtype, k: int = 256,
                impl: str = "pallas", m_cols: int | None = None) -> export.Exported:
  """One gated site as a model runs it, `gated_linear` (g = x V_k, the gate and every
  map's output), on abstract weights of its shapes, exported for `platform`."""
  arg = jax.ShapeDtypeStruct
  W = tuple(arg((d, o), dtype) for o in outs)
  M = tuple(arg((k, m_cols or o), dtype) for o in outs)
  gate = make_gate(0.1, impl=impl, batch1_switch=True)
  fn = jax.jit(lambda x, W, M, V, gate: gated_linear(
      x, GatedWeights(list(W), V, list(M)), gate.eps, gate)[0])
  return export_for(fn, (arg((1, tokens, d), dtype), W, M, arg((d, k), dtype), gate), platform)


# GPT-J-6B's gated sites, (name, d, outputs of each map, M's padded columns): the attention
# input (q, k, v and fc_in: its parallel block reads one normed input), out_proj, fc_out,
# and its untied LM head (50400 outputs; a GSI head's M padded to 50432 columns).
GPTJ_SITES = (("q, k, v, fc_in", 4096, (4096, 4096, 4096, 16384), None),
              ("out_proj", 4096, (4096,), None), ("fc_out", 16384, (4096,), None),
              ("lm_head", 4096, (50400,), 50432))


def gptj_site_launches(platform: str, tokens: int = 1) -> list[dict]:
  """Launches of each GPT-J site at `tokens` tokens per call, bf16, impl="pallas"."""
  records = []
  for name, d, outs, m_cols in GPTJ_SITES:
    launches, others = site_launches(site_export(platform, tokens, d, outs, jnp.bfloat16,
                                                 m_cols=m_cols))
    records.append({"site": name, "platform": platform, "tokens": tokens, "d": d,
                    "outs": list(outs), "launches": launches, "other_ops": others})
  return records


def kept_exports(platform: str, dtype, tokens: int = 1, d: int = 4096,
                 outs=(14336, 14336)) -> dict[tuple[int, ...], export.Exported]:
  """The kept-rows kernel at a site's maps (default: Llama-3-8B's gate and up, one call),
  taking the site's threshold as a model's sparse sites give it, and the kept-dots kernel at
  the first (its up stored transposed), exported for `platform`; keyed by the outputs each
  call serves."""
  arg = jax.ShapeDtypeStruct
  x = arg((tokens, d), dtype)
  rows = export_for(jax.jit(lambda x, t, Ws: kept_kernel.kept_rows_on(platform, x, t, Ws)),
                    (x, arg((), jnp.float32), tuple(arg((d, o), dtype) for o in outs)), platform)
  dots = export_for(jax.jit(lambda x, keep, W: kept_kernel.kept_dots_on(platform, x, keep, W)),
                    (x, arg((tokens, outs[0]), jnp.bool_), arg((outs[0], d), dtype)), platform)
  return {tuple(outs): rows, tuple(outs[:1]): dots}


def _gpt2(name, d, heads):
  return dataclasses.replace(ModelConfig.gpt2_124m(), d_model=d, n_heads=heads,
                             n_kv_heads=heads, d_ff=4 * d, name=name)


def _opt(name, d, heads, proj=0):
  return dataclasses.replace(ModelConfig.opt_6_7b(), d_model=d, n_heads=heads, n_kv_heads=heads,
                             head_dim=d // heads, d_ff=4 * d, embed_proj_dim=proj, name=name)


def _llama(name, d, heads, kv_heads, d_ff, vocab, tied):
  return dataclasses.replace(ModelConfig.smollm2_135m(), vocab_size=vocab, d_model=d,
                             n_heads=heads, n_kv_heads=kv_heads, head_dim=d // heads, d_ff=d_ff,
                             tied_embeddings=tied, name=name)


# The paper's models and Llama's grouped-query widths, as published: every map the kernel
# must lower at.
PAPER_MODELS = (
    _gpt2("gpt2-124m", 768, 12), _gpt2("gpt2-355m", 1024, 16), _gpt2("gpt2-774m", 1280, 20),
    _gpt2("gpt2-1.5b", 1600, 25), ModelConfig.gptj_6b(),
    _opt("opt-125m", 768, 12), _opt("opt-350m", 1024, 16, proj=512), _opt("opt-1.3b", 2048, 32),
    _opt("opt-2.7b", 2560, 32), ModelConfig.opt_6_7b(), _opt("opt-13b", 5120, 40),
    _opt("opt-30b", 7168, 56), _opt("opt-66b", 9216, 72), ModelConfig.smollm2_135m(),
    _llama("llama-3-8b", 4096, 32, 8, 14336, 128256, False),
    _llama("llama-2-70b", 8192, 64, 8, 28672, 32000, False),
    _llama("llama-3.2-1b", 2048, 32, 8, 8192, 128256, True),
)
LOWERING_TOKENS = (1, 16, 256, 2048)  # decode, a short prompt, prefill
LOWERING_DTYPES = ("bfloat16", "float32")
LOWERING_K = 256


def gated_maps(config: ModelConfig) -> set[tuple[int, int, bool]]:
  """(d, O, W stored transposed) of every map one block of `config` gates, and its LM head
  (a tied head reads its (vocab, d) table)."""
  shapes = param_shapes(dataclasses.replace(config, n_layers=1), jnp.bfloat16)
  maps = {(W.shape[0], W.shape[1], False)
          for sites in P.site_kernels(shapes).values() for kernels in sites.values()
          for W in kernels.values()}
  d, vocab = P.head_shape(shapes)
  return maps | {(d, vocab, config.tied_embeddings)}


@functools.cache
def paper_maps() -> tuple[tuple[int, int, bool], ...]:
  return tuple(sorted(set().union(*(gated_maps(c) for c in PAPER_MODELS))))


def distinct_maps(platform: str, tokens: int, dtype: str) -> list[tuple[int, int, bool]]:
  """The first of the paper's maps in each class that lowers alike on `platform`: the
  same blocks and layout of W, whether the reduction is split, whether each path loops,
  whether some split has no rows of M, and the same ragged edges (a map's sizes enter
  the kernel only through these, its loops' trip counts and the grid, which `layout`
  computes for every map)."""
  classes = {}
  for d, out, transposed in paper_maps():
    k = site_rank(LOWERING_K, d)
    lay = tiling.layout(tiling.plan_for(platform, tokens), tokens, d, k, out,
                        itemsize=jnp.dtype(dtype).itemsize)
    ragged = (d % lay.block_d, k % lay.block_k, out % lay.block_o, d % lay.d_chunk,
              k % lay.k_chunk)
    key = (transposed, lay.block_t, lay.block_o, lay.block_d, lay.block_k, lay.splits > 1,
           lay.d_chunk > lay.block_d, lay.k_chunk > lay.block_k,
           lay.splits * lay.k_chunk >= k + lay.k_chunk, *(edge > 0 for edge in ragged))
    classes.setdefault(key, (d, out, transposed))
  return list(classes.values())


def lower_map(platform: str, tokens: int, d: int, out: int, dtype: str,
              w_transposed: bool) -> dict:
  """One map's kernel exported for `platform` (k = 256, capped at d): what it calls."""
  k = site_rank(LOWERING_K, d)
  exported = gated_matmul_export(platform, tokens, d, k, out, jnp.dtype(dtype), w_transposed)
  plan = tiling.plan_for(platform, tokens)
  record = {"platform": platform, "tokens": tokens, "d": d, "k": k, "out": out, "dtype": dtype,
            "w_transposed": w_transposed, "kernel_calls": kernel_calls(exported, platform),
            "other_calls": foreign_calls(exported, platform),
            "interpreter_loops": interpreter_loops(exported),
            "planned_grid": list(tiling.layout(plan, tokens, d, k, out,
                                               itemsize=jnp.dtype(dtype).itemsize).grid)}
  if platform in ARCHES:
    record["launches"] = [{"grid": list(c.grid), "num_warps": c.num_warps,
                           "num_stages": c.num_stages} for c in triton_calls(exported)]
    record["planned_launch"] = {"num_warps": plan.num_warps, "num_stages": plan.num_stages}
  return record


def model_programs(config: ModelConfig, platform: str, impl: str = "auto", head_k: int = 0,
                   tokens: int = 64, params=None, gate=None) -> dict[str, export.Exported]:
  """A GSI model's forward (`tokens` tokens) and one decode step (1 token, KV cache) at k =
  256, bf16, exported for `platform` from abstract parameters: no weights, no calibration.
  params: another method's abstract tree of the same model (in its own dtype), exported
  instead; gate: the gate it runs with, instead of one at eps 0.1 with `impl`."""
  if params is None:
    params = gsi_shapes(param_shapes(config, jnp.bfloat16), LOWERING_K, head_k=head_k)
  dtype = params[P.EMBED][P.EMBEDDING].dtype
  module = Decoder(config, dtype)
  if gate is None:
    gate = make_gate(0.1, impl=impl, batch1_switch=True, head_eps=0.1 if head_k else None)
  arg = jax.ShapeDtypeStruct
  forward = jax.jit(lambda p, ids, gate: module.apply({"params": p}, ids, gate=gate)[0])
  step = jax.jit(lambda p, ids, start, cache, gate: module.apply({"params": p}, ids, start,
                                                                  cache, gate))
  cache = jax.eval_shape(lambda: init_cache(config, 1, tokens + 8, dtype))
  return {"forward": export_for(forward, (params, arg((1, tokens), jnp.int32), gate), platform),
          "decode_step": export_for(step, (params, arg((1, 1), jnp.int32), arg((), jnp.int32),
                                           cache, gate), platform)}


def gated_map_count(config: ModelConfig) -> int:
  shapes = param_shapes(config, jnp.bfloat16)
  return sum(len(kernels) for sites in P.site_kernels(shapes).values()
             for kernels in sites.values())


def gated_site_count(config: ModelConfig) -> int:
  """Sites of gated maps: one kernel call each (its maps share x and g)."""
  shapes = param_shapes(config, jnp.bfloat16)
  return sum(len(sites) for sites in P.site_kernels(shapes).values())


def lower_model(config: ModelConfig, platform: str, impl: str, head_k: int = 0) -> dict:
  """Kernel calls and interpreter loops of a GSI model's forward and decode step."""
  programs = model_programs(config, platform, impl, head_k)
  return {"model": config.name, "platform": platform, "impl": impl, "gated_head": bool(head_k),
          "gated_maps": gated_map_count(config) + bool(head_k),
          "gated_sites": gated_site_count(config) + bool(head_k),
          **{f"{name}_kernel_calls": kernel_calls(e, platform) for name, e in programs.items()},
          **{f"{name}_interpreter_loops": interpreter_loops(e) for name, e in programs.items()},
          **{f"{name}_other_calls": foreign_calls(e, platform) for name, e in programs.items()}}
