"""The kernel lowers for cuda, rocm and tpu at every map shape of the paper's models, on this CPU.

`jax.export` runs each platform's real lowering (Triton on cuda and rocm, Mosaic on tpu),
so a change that breaks the kernel's GPU lowering fails here.  Lowering proves less than
running: test_gpu_binaries.py compiles the Triton IR; benchmarks/gpu_check.sh runs it.
"""

import re

import jax.numpy as jnp
import pytest

from gsi_jax.gpu import programs
from gsi_jax.ops import tiling


def test_paper_maps_are_all_there():
  maps = programs.paper_maps()
  assert (4096, 16384, False) in maps and (16384, 4096, False) in maps  # GPT-J's fc_in, fc_out
  assert (768, 50257, True) in maps and (576, 49152, True) in maps  # tied heads, ragged vocab
  assert (4096, 1024, False) in maps and (576, 192, False) in maps  # GQA's k and v
  assert (9216, 36864, False) in maps and (1600, 6400, False) in maps  # OPT-66B, GPT-2 XL
  assert len(maps) == 58


def test_distinct_maps_cover_every_layout_once():
  """Each platform, token count and dtype lowers one map per class of layout (248 of the
  1392 (map, tokens, dtype, platform) lowerings); every class keeps its first map."""
  picked = {(p, t, dt): programs.distinct_maps(p, t, dt) for p in tiling.PLATFORMS
            for t in programs.LOWERING_TOKENS for dt in programs.LOWERING_DTYPES}
  assert sum(map(len, picked.values())) == 248
  maps = programs.paper_maps()
  for maps_picked in picked.values():
    assert maps_picked[0] == maps[0] and len(set(maps_picked)) == len(maps_picked)
    assert set(maps_picked) <= set(maps)
    assert {transposed for *_, transposed in maps_picked} == {False, True}  # tied heads too


@pytest.mark.parametrize("platform", tiling.PLATFORMS)
@pytest.mark.parametrize("part", range(2))
def test_kernel_lowers_at_every_class_of_paper_map(platform, part):
  """Every class of map (`programs.distinct_maps`) one block of a paper model gates, and
  its LM head, in bf16 and f32, for 1, 16, 256 and 2048 tokens: one compiled kernel call and
  nothing else, launched with the platform's tile plan, and no interpret-mode loop around
  it.  Maps of one class differ only in their grid, which the plan gives."""
  for tokens in programs.LOWERING_TOKENS:
    for dtype in programs.LOWERING_DTYPES:
      for d, out, transposed in programs.distinct_maps(platform, tokens, dtype)[part::2]:
        r = programs.lower_map(platform, tokens, d, out, dtype, transposed)
        assert (r["kernel_calls"], r["other_calls"], r["interpreter_loops"]) == (1, [], 0), r
        if platform in programs.ARCHES:
          assert r["launches"] == [{"grid": r["planned_grid"], **r["planned_launch"]}], r


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("dtype, short", [(jnp.float32, "f32"), (jnp.bfloat16, "bf16")])
def test_kernel_products_are_ieee_in_the_weights_dtype(platform, dtype, short):
  """The prefill plan's tensor-core products (g M and x W) multiply operands in the
  weights' dtype (g cast to M's) at IEEE precision: no TF32, whose errors (near 1e-3) the
  float32 TOLERANCE would not allow on a GPU.  Triton prints inputPrecision only when it is
  not IEEE."""
  exported = programs.gated_matmul_export(platform, 16, 256, 32, 256, dtype)
  dots = [line for call in programs.triton_calls(exported) for line in call.ttir.splitlines()
          if " tt.dot " in line]
  assert len(dots) == 2
  for line in dots:
    assert "inputPrecision" not in line, line
    assert re.findall(r"tensor<[0-9x]+x(\w+)>", line) == [short, short, "f32"], line
