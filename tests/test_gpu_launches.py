"""Kernels a decoded token launches on an H200, from XLA's own GPU compiler on this CPU
(gsi_jax/gpu/launches.py, benchmarks/gpu_launches.py): the thunk parser on a written
sequence anywhere; the compile itself where `make test-jax011` installed jax 0.11.2's CUDA
plugin (GSI_JAX_XLA_GPU), against the committed counts."""

import json
import os
import subprocess
import sys

import pytest

from gsi_jax.gpu import launches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = os.path.join(ROOT, "results", "benchmarks", "gpu_launches.json")
XLA_GPU = os.environ.get("GSI_JAX_XLA_GPU")

SEQUENCE = """\
000: kCommandBuffer [source       | next=003 (1)]
    001: kCustomKernel [source       | next=002 (1) ] loop_add_fusion grid: [1, 1, 1]
    002: kCopy         [source       | sink         ] kCopy
003: kWhile         [prev=000 (1) | sink        ]
condition:
    004: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1]
  body:
    000: kCommandBuffer [source | sink]
        005: kCustomKernel [source       | sink         ] wrapped_add_5 grid: [1, 1, 1]
        006: kCustomKernel [source       | next=007 (1) ] gemm_fusion_dot_37 grid: [1024, 1, 1]
        007: kConditional  [prev=006 (1) | next=011 (1) ]
          false_branch:
            008: kCustomKernel [source       | sink        ] input_reduce_fusion_12 grid: [16, 1, 1]
            009: kCustomKernel [prev=008 (1) | sink        ] gsi_gated_matmul__3 grid: [1, 224, 2]
          true_branch:
            010: kCustomKernel [source       | sink        ] gemm_fusion_dot_43 grid: [8192, 1, 1]
        011: kCustomKernel [prev=007 (1) | sink         ] input_reduce_fusion_14 grid: [64, 1, 1]
"""


def test_a_tokens_launches_are_the_while_bodys_thunks():
  """Always-run kernels outside conditionals, each branch's apart, the larger branch for
  the worst case; the prefill before the loop and its condition are not a token's."""
  got = launches.while_body_launches(SEQUENCE)
  assert (got.always, got.conditionals, got.command_buffers) == (3, 1, 1)
  assert got.branches == [{"false_branch": 2, "true_branch": 1}]
  assert got.largest == 5
  assert got.by_kind == {"gemm": 2, "pallas": 1, "reduction": 2, "wrapped elementwise": 1}


def test_a_command_buffers_kernels_are_its_indented_thunks():
  text = ("000: kCommandBuffer [source | sink]\n"
          "    001: kCustomKernel [source | next=002 (1)] gsi_floor grid: [1, 1, 1]\n"
          "    002: kCustomKernel [prev=001 (1) | sink] gsi_floor grid: [1, 1, 1]\n"
          "003: kCopy  [source | sink] kCopy\n"
          "004: kCommandBuffer [source | sink]\n"
          "    005: kCustomKernel [source | sink] loop_add_fusion grid: [1, 1, 1]\n")
  assert launches.command_buffers(text) == (
      [["gsi_floor", "gsi_floor"], ["loop_add_fusion"]], ["kCopy"])


def test_the_launch_floor_is_one_command_buffer_of_every_call():
  """The committed compile: each launch-floor program (a Pallas kernel, an XLA fusion) runs
  its LAUNCH_FLOOR_CALLS calls as one CUDA graph, as a decode's kernels run, and launches
  nothing outside it (a loop would have timed a host launch and a condition per call)."""
  from gsi_jax.measure.benchmarking import LAUNCH_FLOOR_CALLS, LAUNCH_FLOOR_KINDS
  floor = committed()["launch_floor"]
  assert floor["calls"] == LAUNCH_FLOOR_CALLS
  for kind in LAUNCH_FLOOR_KINDS:
    assert floor[kind] == {"command_buffers": 1, "kernels_in_buffers": [LAUNCH_FLOOR_CALLS],
                           "kernels_outside": 0}, kind


def test_a_program_without_a_loop_is_refused():
  with pytest.raises(launches.GSIError, match="no while loop"):
    launches.while_body_launches(SEQUENCE.split("003: kWhile")[0])


@pytest.mark.parametrize("name, kind", [
    ("gsi_gated_matmul__3", "pallas"), ("kept_rows_matmul", "pallas"),
    ("gemm_fusion_dot_37", "gemm"), ("input_reduce_fusion_40", "reduction"),
    ("triton_softmax_6", "reduction"), ("loop_select_fusion_6", "elementwise"),
    ("wrapped_add_5", "wrapped elementwise"), ("kCopy", "copy")])
def test_kernel_kinds(name, kind):
  assert launches.kernel_kind(name) == kind


def committed() -> dict:
  with open(COMMITTED, encoding="utf-8") as f:
    return json.load(f)


def test_the_committed_counts_cover_every_program_and_batch():
  result = committed()
  assert "complete" not in result and result["layers"] == 28
  assert result["plugin"] == list(launches.PLUGIN)
  rows = {(r["program"], r["batch"]) for r in result["records"]}
  assert rows == {(p, b) for p in launches.PROGRAMS for b in (1, 4, 16)}
  assert {(r["program"], r["batch"]) for r in result["check"]["records"]} == {
      (p, b) for p in launches.PROGRAMS for b in result["check"]["batches"]}
  assert result["check"]["batches"] == [1, 4]
  # The depth gpu_check.sh decodes at, whose kernels gpu_summary.py fits a kernel's cost to.
  assert (result["fit"]["layers"], result["fit"]["batch"]) == (4, 1)
  assert [r["program"] for r in result["fit"]["records"]] == list(launches.PROGRAMS)
  assert all(r["kernels"] > 0 and r["compile_s"] > 0 for r in result["fit"]["records"])
  for r in result["records"]:
    dense = next(d for d in result["records"] if d["program"] == "dense"
                 and d["batch"] == r["batch"])
    assert r["kernels_with_larger_branches_over_dense"] == pytest.approx(
        r["kernels_with_larger_branches"] / dense["kernels"])
    assert r["kernels_with_larger_branches"] >= r["kernels"]


# The most kernels a decoded token may launch at 1, 4 and 16 sequences, over dense's at the
# same batch (GSI at eps = 0: exactly dense's program), and the most conditionals in any
# program.
TARGETS = {"gsi_static": 1.15, "gsi_gated": 1.3, "sparsity": 1.05}


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_no_program_launches_more_than_its_target(batch):
  """GSI static, gated and sparsity within their ratio to dense; GSI at eps = 0 is dense's
  program; no program holds more than one conditional.  A change that raises a count past
  its target fails here once the JSON is written anew (and before, in the recompile below)."""
  at = {r["program"]: r for r in committed()["records"] if r["batch"] == batch}
  for program, target in TARGETS.items():
    assert at[program]["kernels_with_larger_branches_over_dense"] <= target, program
  assert (at["gsi_eps0"]["kernels"], at["gsi_eps0"]["by_kind"]) == (
      at["dense"]["kernels"], at["dense"]["by_kind"])
  assert all(r["conditionals"] <= 1 for r in at.values())


def test_the_makefile_installs_the_plugin_the_module_names():
  text = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
  assert f"XLA_GPU_PKGS := {' '.join(launches.PLUGIN)}\n" in text


@pytest.mark.skipif(not XLA_GPU, reason="jax 0.11.2's CUDA plugin: make test-jax011 installs it")
def test_the_small_programs_launch_what_the_committed_run_counted(tmp_path):
  """Each program at the committed check's depth, compiled again: any change to the code
  that moves a count (up or down) fails here until the JSON is written anew."""
  check = committed()["check"]
  out = tmp_path / "launches.json"
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_launches.py"),
       f"--layers={check['layers']}", "--check_layers=0",
       f"--batch={','.join(map(str, check['batches']))}",
       f"--out={out}"], capture_output=True, text=True, cwd=ROOT, timeout=900,
      env={**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([XLA_GPU, ROOT])})
  assert proc.returncode == 0, proc.stderr[-3000:]
  written = json.loads(out.read_text())
  assert written["launch_floor"] == committed()["launch_floor"]
  fresh = {(r["program"], r["batch"]): r for r in written["records"]}
  for want in check["records"]:
    got = fresh[want["program"], want["batch"]]
    for key in ("kernels", "kernels_with_larger_branches", "conditionals", "by_kind"):
      assert got[key] == want[key], (want["program"], key)


def test_results_section_14_2_is_the_jsons():
  """Every row of RESULTS §14.2's table, read from the document, against the two JSONs;
  and the targets its prose calls met or not met."""
  import re
  with open(os.path.join(ROOT, "RESULTS.md"), encoding="utf-8") as f:
    section = f.read().split("### 14.2 ", 1)[1].split("\n## ", 1)[0]
  rows = re.findall(r"^\| (\w+) \| (\d+) \| (\d+) \| ([\d.]+)× \| (\d+) \| ([^|]+) \|$",
                    section, re.M)
  result = committed()
  with open(os.path.join(ROOT, "results", "benchmarks", "gpu_launches_before_cuts.json"),
            encoding="utf-8") as f:
    before = {r["program"]: r for r in json.load(f)["records"]}
  assert len(rows) == len(result["records"])
  for (program, batch, kernels, ratio, conditionals, was), r in zip(rows, result["records"]):
    assert (program, int(batch)) == (r["program"], r["batch"])
    assert int(kernels) == r["kernels_with_larger_branches"]
    assert ratio == f"{r['kernels_with_larger_branches_over_dense']:.2f}"
    assert int(conditionals) == r["conditionals"] and r["command_buffers"] == 1
    b = before.get(program) if r["batch"] == 1 else None
    assert was.strip() == (f"{b['kernels_with_larger_branches']} ({b['conditionals']})"
                           if b else "—")
  at = {(r["program"], r["batch"]): r for r in result["records"]}
  ratio = lambda p, b: at[p, b]["kernels_with_larger_branches_over_dense"]
  assert all(at["gsi_eps0", b]["kernels"] == at["dense", b]["kernels"] for b in (1, 4, 16))
  assert max(r["conditionals"] for r in result["records"]) == 0  # "no program holds one"
  text = re.sub(r"<!--.*?-->", "", section).replace("\n", " ")
  names = {"gsi_static": "GSI static", "gsi_gated": "gated", "sparsity": "sparsity"}
  met = all(ratio(p, b) <= t for p, t in TARGETS.items() for b in (1, 4, 16))
  for program, target in TARGETS.items():
    claim = (f"{names[program]} ({ratio(program, 1):.2f}× at 1 sequence, "
             f"{ratio(program, 4):.2f}× at 4, {ratio(program, 16):.2f}× at 16; "
             f"target ≤ {target}×)")
    assert claim in text, claim
  assert ("are met." in text) == met
  sites = 3 * result["layers"]  # GPT-J's gated sites a layer: q k v fc_in, out_proj, fc_out
  assert "at least a kernel a site more than gated" in text
  assert all(at["gsi_coin", b]["kernels"] - at["gsi_gated", b]["kernels"] >= sites
             for b in (1, 4, 16))


def test_readme_quotes_the_counts():
  """README gives each program's kernels a token (marked, tests/test_docs.py) and calls
  GSI at eps = 0 dense's program, which the counts bear out."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    readme = " ".join(f.read().split())
  one = {r["program"]: r for r in committed()["records"] if r["batch"] == 1}
  assert "(dense's program)" in readme
  assert one["gsi_eps0"]["kernels"] == one["dense"]["kernels"]
  assert one["gsi_eps0"]["conditionals"] == one["gsi_gated"]["conditionals"] == 0
