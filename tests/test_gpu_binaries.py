"""Every GPU tile plan compiles to an sm_90 cubin and a gfx942 code object on this CPU, and
fits its chip: no spills, at most 64 KB of shared memory (an MI300X's LDS), and on an H200
room for at least 2 programs per SM.  Compiled, not run."""

import json
import os
import re
from collections import Counter

import jax.numpy as jnp
import pytest

from gsi_jax import lowering
from gsi_jax.models import params as P
from gsi_jax.ops import tiling
from tests.conftest import once_per_run

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def records(tmp_path_factory, worker_id):
  return once_per_run(tmp_path_factory, worker_id, "plan_binaries", lowering.plan_binaries)


def test_every_plan_compiles_and_fits(records):
  assert {(r["platform"], r["regime"]) for r in records} == \
      {(p, regime) for p in lowering.ARCHES for regime in lowering.PLAN_CASES}
  for r in records:
    where = f"{r['platform']} {r['regime']} {r['dtype']} T={r['tokens']} d={r['d']} O={r['out']}"
    assert r["spill_bytes"] == 0, where
    assert 0 < r["registers"] <= 256, where
    if r["arch"] == "gfx942":
      assert r["shared_bytes"] <= lowering.GFX942_LDS, where
      assert r["occupancy"] >= 2, where
    else:
      assert r["programs_per_sm"] >= 2, where


def test_the_binaries_run_the_tile_plans(records):
  for r in records:
    plan = tiling.plan_for(r["platform"], r["tokens"])
    lay = tiling.layout(plan, r["tokens"], r["d"], r["k"], r["out"],
                        P.head_m_columns(r["out"]) if r["w_transposed"] else 0,
                        jnp.dtype(r["dtype"]).itemsize)
    assert r["grid"] == list(lay.grid)
    assert (r["num_warps"], r["num_stages"]) == (plan.num_warps, plan.num_stages)


def test_committed_figures_are_current(records):
  """results/benchmarks/gpu_lowering.json (quoted in RESULTS.md §14) holds what this Triton
  compiles today."""
  path = os.path.join(os.path.dirname(__file__), "..", "results", "benchmarks",
                      "gpu_lowering.json")
  with open(path) as f:
    saved = json.load(f)
  if saved["triton_version"] != triton.__version__:
    pytest.skip(f"figures are from triton {saved['triton_version']}")
  keys = ("platform", "regime", "dtype", "tokens", "d", "out", "registers", "spill_bytes",
          "shared_bytes", "grid")
  assert [{k: r[k] for k in keys} for r in saved["binaries"]] == \
      [{k: r[k] for k in keys} for r in records]


def _global_loads(m_cols, out=50257):
  """The sm_90 PTX global loads of GPT-2's tied head at one token in bf16 (the decode
  plan), with M stored with m_cols columns."""
  exported = lowering.gated_matmul_export("cuda", 1, 768, 256, out, jnp.bfloat16, True, m_cols)
  [call] = lowering.triton_calls(exported)
  return Counter(re.findall(r"ld\.global[.\w]*", lowering.compile_call(call, "sm_90").asm["ptx"]))


def test_the_heads_padded_M_is_read_with_vector_loads():
  """With 50257 columns every row of M starts unaligned and M's tiles load one bf16 at a
  time; padded to 50304 (P.head_m_columns), they load as 128-bit vectors, as an aligned
  map's do."""
  assert P.head_m_columns(50257) == 50304
  padded, unpadded = _global_loads(50304), _global_loads(None)
  assert padded == _global_loads(None, out=50304)  # a vocabulary that needs no padding
  assert padded["ld.global.b16"] < unpadded["ld.global.b16"]
  assert padded["ld.global.v4.b32"] > unpadded["ld.global.v4.b32"]
