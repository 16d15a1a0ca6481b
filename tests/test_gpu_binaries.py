"""Every GPU tile plan, and the kept-rows and kept-dots kernels, compile to an sm_90 cubin
and a gfx942 code object on this CPU and fit their chip: no spills, at most 64 KB of shared
memory (an MI300X's LDS), at least 2 programs per SM or CU in bf16 and enough bytes in
flight for Little's law; and their main loops hold loads and arithmetic, not reductions.
Compiled, not run."""

import json
import os
import re
from collections import Counter

import jax.numpy as jnp
import pytest

from gsi_jax.gpu import binaries, programs
from gsi_jax.models import params as P
from gsi_jax.ops import tiling
from tests.conftest import once_per_run

triton = pytest.importorskip("triton")
if triton.__version__ != binaries.CPU_TRITON_VERSION:  # make test puts the pinned one first
  pytest.skip(f"triton {triton.__version__} is not the pinned {binaries.CPU_TRITON_VERSION}; "
              "run with PYTHONPATH=.venv/cpu-triton", allow_module_level=True)


@pytest.fixture(scope="module")
def records(tmp_path_factory, worker_id):
  return once_per_run(tmp_path_factory, worker_id, "plan_binaries", binaries.plan_binaries)


@pytest.fixture(scope="module")
def kept_records(tmp_path_factory, worker_id):
  return once_per_run(tmp_path_factory, worker_id, "kept_binaries", binaries.kept_binaries)


def _where(r) -> str:
  return " ".join(f"{k}={r[k]}" for k in ("kernel", "platform", "regime", "dtype", "tokens",
                                            "d", "out", "outs") if k in r)


def test_every_plan_compiles_and_fits(records, kept_records):
  """bf16 (the weights GPUs decode in) holds 2 programs per SM or CU and the bytes in flight
  that Little's law asks; float32's batch tiles (IEEE products on CUDA cores) hold at least
  1 on an H200, without spilling."""
  assert {(r["platform"], r["regime"]) for r in records} == \
      {(p, regime) for p in programs.ARCHES for regime in binaries.PLAN_CASES}
  assert {(r["kernel"], r["arch"], r["tokens"]) for r in kept_records} == \
      {(k, a, t) for k in ("kept_rows", "kept_dots") for a in ("sm_90", "gfx942") for t in (1, 16)}
  for r in records + kept_records:
    assert r["spill_bytes"] == 0, _where(r)
    assert 0 < r["registers"] <= 256, _where(r)
    if r["arch"] == "gfx942":
      assert r["shared_bytes"] <= binaries.GFX942_LDS, _where(r)
    bf16 = r["dtype"] == "bfloat16"
    assert r["programs_per_unit"] >= (binaries.RESIDENT_AT_LEAST if bf16 else 1), _where(r)
    if bf16 and r.get("regime", "decode") != "prefill":
      assert r["in_flight_bytes_per_unit"] >= r["needed_bytes_per_unit"], _where(r)


def test_main_loops_hold_no_reduction(records, kept_records):
  """Issue 53's compiled evidence.  At one token (the slow, fast and kept paths) a loop
  step has no cross-lane shuffle and no barrier: its products go into a 2-D accumulator,
  reduced once after the loop.  With several tokens a step is a dot whose only barriers
  are its load pipeline's (at most 2 a loop; 4 in kept rows, whose row flags load a stage
  ahead of the W rows they mask), and on sm_90 its tiles arrive by cp.async.
  The weights load 16 bytes at a time.  GPT-J's fc_out (a 64-split reduction of 8 steps
  of W at one token) keeps a loop on both chips, so the check is not vacuous there."""
  for r in records + kept_records:
    loops = r["loops"]
    in_loops = loops["in_loops"]
    assert in_loops["shuffles"] == 0, (_where(r), loops)
    if r["tokens"] == 1:
      assert in_loops["barriers"] == 0, (_where(r), loops)
    else:  # kept rows: the row flags arrive a pipeline stage ahead of the W rows they mask
      per_loop = 4 if r.get("kernel") == "kept_rows" else 2
      assert in_loops["barriers"] <= per_loop * loops["loops"], (_where(r), loops)
      if r["arch"] == "sm_90" and loops["loops"]:
        assert in_loops["async_copies"] > 0, (_where(r), loops)
    if r["tokens"] == 1 and loops["loops"]:
      assert in_loops["loads_16B"] > 0, (_where(r), loops)
    assert loops["whole"]["loads_16B"] > 0, (_where(r), loops)
  fc_out = [r for r in records
            if (r["regime"], r["d"], r["dtype"]) == ("decode", 16384, "bfloat16")]
  assert {r["arch"] for r in fc_out if r["loops"]["loops"] >= 1} == {"sm_90", "gfx942"}


def test_loop_profile_sees_a_reduction_in_a_loop():
  """The profile can fail: a shuffle and a barrier between a loop header and its latch count
  as inside; the same after the latch do not, nor does a forward branch."""
  ptx = """
  ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];
  @%p1 bra $L__BB0_3;
$L__BB0_2:                              // =>This Inner Loop Header: Depth=1
  ld.global.L1::evict_first.v4.b32 {%r1, %r2, %r3, %r4}, [%rd2];
  shfl.sync.bfly.b32 %r5, %r6, 16, 31, -1;
  bar.sync 0;
  @%p2 bra $L__BB0_2;
$L__BB0_3:
  shfl.sync.bfly.b32 %r5, %r6, 16, 31, -1;
  shfl.sync.idx.b32 %r7, %r8, 0, 31, -1;
"""
  profile = binaries.loop_profile(ptx, "sm_90")
  assert profile["loops"] == 1
  assert profile["in_loops"] == {"shuffles": 1, "barriers": 1, "loads_16B": 1, "loads": 1,
                                 "async_copies": 0}
  assert profile["whole"]["shuffles"] == 2 and profile["whole"]["loads_16B"] == 2
  amdgcn = """
.LBB0_4:                                ; =>This Inner Loop Header: Depth=1
  global_load_dwordx4 v[2:5], v[6:7], off
  v_mov_b32_dpp v12, v2 quad_perm:[2,3,0,1] row_mask:0xf bank_mask:0xf
  s_barrier
  s_cbranch_scc1 .LBB0_4
"""
  assert binaries.loop_profile(amdgcn, "gfx942")["in_loops"] == {
      "shuffles": 1, "barriers": 1, "loads_16B": 1, "loads": 1, "async_copies": 0}


def test_the_binaries_run_the_tile_plans(records):
  for r in records:
    plan = tiling.plan_for(r["platform"], r["tokens"])
    lay = tiling.layout(plan, r["tokens"], r["d"], r["k"], r["out"],
                        P.head_m_columns(r["out"]) if r["w_transposed"] else 0,
                        jnp.dtype(r["dtype"]).itemsize)
    assert r["grid"] == list(lay.grid)
    assert (r["num_warps"], r["num_stages"]) == (plan.num_warps, plan.num_stages)


def test_committed_figures_are_current(records, kept_records):
  """results/benchmarks/gpu_lowering.json (quoted in RESULTS.md §14) holds what this Triton
  compiles today."""
  path = os.path.join(os.path.dirname(__file__), "..", "results", "benchmarks",
                      "gpu_lowering.json")
  with open(path) as f:
    saved = json.load(f)
  if saved["triton_version"] != triton.__version__:
    pytest.skip(f"figures are from triton {saved['triton_version']}")
  keys = ("platform", "regime", "dtype", "tokens", "d", "out", "registers", "spill_bytes",
          "shared_bytes", "grid", "loops")
  assert [{k: r[k] for k in keys} for r in saved["binaries"]] == \
      [{k: r[k] for k in keys} for r in records]
  assert saved["kept_binaries"] == kept_records


def _global_loads(m_cols, out=50257):
  """The sm_90 PTX global loads of GPT-2's tied head at one token in bf16 (the decode
  plan), with M stored with m_cols columns."""
  exported = programs.gated_matmul_export("cuda", 1, 768, 256, out, jnp.bfloat16, True, m_cols)
  [call] = programs.triton_calls(exported)
  ptx = binaries.compile_call(call, "sm_90").asm["ptx"]
  # By width, the cache hints (.L1::evict_first, .L2::cache_hint) left out.
  return Counter(re.sub(r"\.L[12]::\w+", "", load)
                 for load in re.findall(r"ld\.global[.\w:]*", ptx))


def test_the_heads_padded_M_is_read_with_vector_loads():
  """With 50257 columns every row of M starts unaligned and M's tiles load one bf16 at a
  time; padded to 50304 (P.head_m_columns), they load as 128-bit vectors, as an aligned
  map's do."""
  assert P.head_m_columns(50257) == 50304
  padded, unpadded = _global_loads(50304), _global_loads(None)
  assert padded == _global_loads(None, out=50304)  # a vocabulary that needs no padding
  assert padded["ld.global.b16"] < unpadded["ld.global.b16"]
  assert padded["ld.global.v4.b32"] > unpadded["ld.global.v4.b32"]
