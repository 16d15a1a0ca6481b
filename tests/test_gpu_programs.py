"""Whole GPU programs lower on this CPU: a GSI model's forward and decode step run one compiled
kernel per gated site (every map that reads the site's input) for cuda and rocm, a gated
site is g = x V_k and one kernel beside XLA's reductions at GPT-J's shapes, and the XLA
decode step and the streaming calibration's device work carry nothing CPU-only (no host
callback, no float64, no CPU library)."""

import dataclasses
import functools
import math
import json
import os

import jax
import jax.numpy as jnp
import pytest

from gsi_jax.gpu import binaries, programs
from gsi_jax.gsi import calibration, solvers
from gsi_jax.loading.load import param_shapes
from gsi_jax.models import ModelConfig
from gsi_jax.models import params as P
from gsi_jax.models.decoder import Block
from gsi_jax.ops import tiling

GPU = tuple(programs.ARCHES)


@pytest.mark.parametrize("platform", GPU)
@pytest.mark.parametrize("impl", ["pallas", "auto"])
def test_default_model_runs_one_kernel_per_gated_site(platform, impl):
  """SmolLM2-135M: 210 gated maps (30 layers × q, k, v, o, gate, up, down) in 120 sites
  (q, k, v; o; gate, up; down), 120 compiled kernel calls in the forward and in the decode
  step, one more with the gated LM head (pallas), and no interpret mode."""
  config = ModelConfig.smollm2_135m()
  assert programs.gated_map_count(config) == 210
  r = programs.lower_model(config, platform, impl, head_k=256 if impl == "pallas" else 0)
  for program in ("forward", "decode_step"):
    assert r[f"{program}_kernel_calls"] == r["gated_sites"] == 120 + r["gated_head"], r
    assert r[f"{program}_interpreter_loops"] == 0 and r[f"{program}_other_calls"] == [], r


@pytest.mark.parametrize("name", ["gptj", "opt", "gpt2"])
def test_other_families_run_one_kernel_per_gated_site(name):
  """GPT-J's parallel block (fc_in beside q, k, v: one site), OPT's and GPT-2's tied heads;
  two layers."""
  config = {"gptj": ModelConfig.gptj_6b(), "opt": ModelConfig.opt_6_7b(),
            "gpt2": ModelConfig.gpt2_124m()}[name]
  r = programs.lower_model(dataclasses.replace(config, n_layers=2), "cuda", "pallas", head_k=256)
  assert r["forward_kernel_calls"] == r["decode_step_kernel_calls"] == r["gated_sites"]
  assert r["gated_sites"] == (7 if name == "gptj" else 9) < r["gated_maps"]


@pytest.mark.parametrize("platform", GPU)
@pytest.mark.parametrize("tokens", [1, 16])
def test_a_site_is_one_product_one_kernel_and_xlas_reductions(platform, tokens):
  """Each of GPT-J's gated sites and its GSI head, gated (ε > 0), is g = x V_k and one
  kernel call (the maps of a site share it, a ragged last block is stored masked), beside
  what XLA fuses as it sees fit: the gate's two norms per token (‖x‖², ‖g‖²), decided once
  before the call, and the sum over the splits of the reduction, added by halves
  (`fused_sum`: no reduce, so XLA fuses it into what reads it).  Its other branch (ε ≤ 0,
  where no token can be fast) is one dense product per map, so the program's text holds
  2 + maps products and kernels, and three reduces whatever the splits."""
  for r in programs.gptj_site_launches(platform, tokens):
    maps = len(r["outs"])
    lay = tiling.layout(tiling.plan_for(platform, tokens), tokens, r["d"], 256, r["outs"])
    assert r["launches"] == 2 + maps, r
    assert r["other_ops"]["stablehlo.reduce"] == 3, r
    halvings = math.ceil(math.log2(lay.splits))
    assert lay.splits == 1 or r["other_ops"]["stablehlo.add"] >= maps * halvings, r
    assert not set(r["other_ops"]) - XLA_GATE_AND_SUM_OPS, r


# The elementwise work of the gate, the token states (PADDING past the tokens), and the
# split sums.
XLA_GATE_AND_SUM_OPS = frozenset({
    "stablehlo.convert", "stablehlo.multiply", "stablehlo.reduce", "stablehlo.add",
    "stablehlo.subtract", "stablehlo.broadcast_in_dim", "stablehlo.compare", "stablehlo.and",
    "stablehlo.select", "stablehlo.pad", "stablehlo.slice", "stablehlo.iota"})


def test_tpu_and_cpu_pick_their_own_kernels():
  """The same program lowered for tpu calls Mosaic kernels; for cpu, impl="pallas" runs the
  kernel in interpret mode and impl="auto" takes the XLA path (no kernel, no loop)."""
  config = dataclasses.replace(ModelConfig.smollm2_135m(), n_layers=2)
  tpu = programs.lower_model(config, "tpu", "pallas")
  assert tpu["forward_kernel_calls"] == tpu["decode_step_kernel_calls"] == 8
  for program in programs.model_programs(config, "cpu", "pallas", tokens=16).values():
    assert not programs.custom_call_targets(program)[programs.TRITON_CALL]
    assert programs.interpreter_loops(program) > 0
  for program in programs.model_programs(config, "cpu", "auto", tokens=16).values():
    assert not programs.custom_call_targets(program)
    assert programs.interpreter_loops(program) == 0


def assert_gpu_clean(exported, platform):
  assert not programs.has_host_callback(exported)
  assert not programs.has_float64(exported)
  assert programs.foreign_calls(exported, platform) == []


@pytest.mark.parametrize("platform", GPU)
def test_xla_decode_step_lowers(platform):
  exports = programs.model_programs(ModelConfig.smollm2_135m(), platform, "xla")
  for exported in exports.values():
    assert_gpu_clean(exported, platform)
    assert programs.kernel_calls(exported, platform) == 0


@pytest.mark.parametrize("platform", GPU)
def test_calibration_step_lowers(platform):
  """The streaming calibration's per-layer device work at GPT-J's shape: the layer forward
  that sows site inputs, the Gram accumulation, the trace, and LOBPCG (krylov and cascade)."""
  config = dataclasses.replace(ModelConfig.gptj_6b(), n_layers=1)
  layer = param_shapes(config, jnp.bfloat16)[P.layer_name(0)]
  x = jax.ShapeDtypeStruct((4, 256, config.d_model), jnp.bfloat16)
  forward = jax.jit(functools.partial(calibration.layer_forward, block=Block(config,
                                                                             jnp.bfloat16)))
  assert_gpu_clean(programs.export_for(forward, (layer, x), platform), platform)
  _, inputs = jax.eval_shape(forward, layer, x)
  grams = {site: jax.ShapeDtypeStruct((v.shape[-1],) * 2, jnp.float32)
           for site, v in inputs.items()}
  add = jax.jit(functools.partial(calibration._add_grams, mesh=None))
  assert_gpu_clean(programs.export_for(add, (grams, inputs), platform), platform)
  G = jax.ShapeDtypeStruct((config.d_ff, config.d_ff), jnp.float32)
  assert_gpu_clean(programs.export_for(calibration._trace, (G,), platform), platform)
  start = jax.ShapeDtypeStruct((config.d_ff, 256), jnp.float32)
  exported = programs.export_for(solvers._lobpcg, (G, start), platform)
  assert_gpu_clean(exported, platform)
  assert any("syevd" in t for t in programs.custom_call_targets(exported))


def test_cpu_only_work_is_caught():
  """The checks above can fail: a host callback does not even lower for cuda, a CPU library
  call (LAPACK) is foreign, and float64 is seen."""
  arg = jax.ShapeDtypeStruct((4, 4), jnp.float32)
  callback = jax.jit(lambda x: jax.pure_callback(lambda a: a, arg, x))
  with pytest.raises(ValueError, match="lowering platform cuda"):
    programs.export_for(callback, (arg,), "cuda")
  eigh = jax.jit(lambda x: jnp.linalg.eigh(x)[0])
  assert any("lapack" in t for t in programs.foreign_calls(
      programs.export_for(eigh, (arg,), "cpu"), "cuda"))
  with jax.enable_x64(True):
    wide = jax.jit(lambda x: (x.astype(jnp.float64) * 2).astype(jnp.float32))
    assert programs.has_float64(programs.export_for(wide, (arg,), "cuda"))


def test_committed_site_figures_are_current():
  """results/benchmarks/gpu_lowering.json (quoted in RESULTS.md and BUILD_NOTES.md) holds the
  launches and the decode tiles' bytes in flight that the code gives today."""
  path = os.path.join(os.path.dirname(__file__), "..", "results", "benchmarks",
                      "gpu_lowering.json")
  with open(path) as f:
    saved = json.load(f)
  assert saved["decode_bandwidth"] == binaries.gptj_decode_bandwidth()
  assert saved["gptj_sites"] == [r for platform in GPU for tokens in (1, 16)
                                 for r in programs.gptj_site_launches(platform, tokens)]


@pytest.mark.long
def test_every_method_exports_its_kernel_calls(tiny_folder, tmp_path):
  """`gpu_lowering.py --export_dir` on a tiny Llama: dense and every registered method's
  first point, forward and decode, for cuda and rocm, each written as StableHLO text; each
  method whose fast path is a Pallas kernel calls it at least once per site it rewrites
  (CATS twice in an MLP: up and down), the others (svd) none; nothing CPU-only."""
  import subprocess
  import sys
  from gsi_jax import methods
  folder, _ = tiny_folder("llama_gqa")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
      [sys.executable, os.path.join(root, "benchmarks", "gpu_lowering.py"),
       f"--export_dir={tmp_path}", f"--model={folder}", "--k=8", "--calib_tokens=256",
       "--seq_len=32"], capture_output=True, text=True, cwd=root, timeout=900,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((tmp_path / "programs.json").read_text())
  rows = result["programs"]
  assert {r["method"] for r in rows} == {"dense", *methods.names()}
  assert len(rows) == 4 * (1 + len(methods.names())) and result["passed"] == len(rows)
  for r in rows:
    text = (tmp_path / r["file"]).read_text()
    assert "module @jit" in text and "stablehlo." in text
    assert r["file"] == f"{r['method']}-{r['platform']}-{r['phase']}.mlir"
    assert r["cpu_only_calls"] == [] and r["interpreter_loops"] == 0
    if r["expects_kernel"]:
      assert r["kernel_calls"] >= r["fast_sites"] > 0, r
  by = {(r["method"], r["platform"], r["phase"]): r for r in rows}
  sites = programs.gated_site_count(dataclasses.replace(ModelConfig.smollm2_135m(), n_layers=2))
  assert by["gsi", "cuda", "decode"]["kernel_calls"] == sites == 8  # 2 layers of 4 sites
  assert by["gsi_out", "rocm", "forward"]["kernel_calls"] == sites  # decided, then the kernel
  assert by["dense", "cuda", "decode"]["kernel_calls"] == by["svd", "cuda", "decode"][
      "kernel_calls"] == 0


def test_the_committed_method_programs():
  """results/benchmarks/gpu_programs/programs.json (RESULTS §14): the default model's first
  4 blocks, every method, both GPU platforms and phases, all passing."""
  from tests.conftest import methods_in_committed
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "results", "benchmarks", "gpu_programs", "programs.json"),
            encoding="utf-8") as f:
    result = json.load(f)
  rows = result["programs"]
  assert result["layers"] == 4 and result["passed"] == len(rows) == 76
  ran = methods_in_committed("programs.json", (r["method"] for r in rows if r["method"] != "dense"))
  calls = {r["method"]: r["kernel_calls"] for r in rows}
  assert calls == {**dict.fromkeys(ran, 16), "dense": 0, "svd": 0, "cats": 8,
                   "head": 1, "sparsity+head": 17}
  assert all(r["cpu_only_calls"] == [] and r["passed"] for r in rows)
