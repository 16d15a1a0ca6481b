"""The methods registry: all eighteen methods in it, each declared whole; a method that
exists only in a test, registered from its own file, runs through pareto with no other
change; knobs of methods a run does not evaluate are refused."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from absl import flags

from gsi_jax import cli, methods
from gsi_jax.errors import GSIError
from gsi_jax.methods.common import KEPT_ROWS, by_tree, sparse_bytes
from tests import global_sparsity
from tests.test_experiments import ROOT, SMALL, experiment_module, run_in_process

# The methods this package ships (a method added later is registered beside them).
EIGHTEEN = {"gsi", "gsi_out", "gsi_ladder", "static", "svd", "sparsity", "head", "sparsity+head",
            "larosa", "residual", "rsparse", "cats", "sparsity_greedy", "sparsity_learned",
            "gsi_learned", "residual_learned", "residual_rank_learned", "rsparse_searched"}


def test_the_registry_holds_every_method_declared_whole():
  assert EIGHTEEN <= set(methods.names())
  for name, method in methods.REGISTRY.items():
    assert method.name == name and method.doc and callable(method.points)
    assert set(method.fast_path) == set(methods.PLATFORMS), name
    assert all(isinstance(k, methods.Knob) for k in method.knobs)
    if method.learned:
      assert method.uniform in methods.REGISTRY
  # Allocations (learned, greedy, searched) are compared with their uniform method.
  allocated = {n: m.uniform for n, m in methods.REGISTRY.items() if m.uniform and n in EIGHTEEN}
  assert allocated == {"sparsity_greedy": "sparsity", "sparsity_learned": "sparsity",
                       "gsi_learned": "gsi", "residual_learned": "residual",
                       "residual_rank_learned": "residual", "rsparse_searched": "rsparse"}
  # One flag, one meaning: a knob shared by methods is one Knob.
  assert methods.users("sparsity") == ("sparsity", "larosa", "sparsity+head")


def test_registering_a_name_twice_or_a_knob_two_ways_is_refused():
  with pytest.raises(GSIError, match="already registered"):
    methods.register(methods.REGISTRY["sparsity"])
  clash = methods.Knob("sparsity", float, ("0.5",), "another meaning")
  with pytest.raises(GSIError, match="already declared differently"):
    methods.register(methods.Method("other", "x", (clash,), lambda ctx: (),
                                    lambda point: None, dict.fromkeys(methods.PLATFORMS, "x")))
  with pytest.raises(GSIError, match="names no fast path"):
    methods.register(methods.Method("other", "x", (), lambda ctx: (), lambda point: None,
                                    {"cpu": "x"}))
  assert "other" not in methods.REGISTRY


@pytest.fixture
def example_method():
  """tests/global_sparsity.py's method, registered for one test (and its knob a flag)."""
  methods.register(global_sparsity.METHOD)
  cli.define_knob_flags(methods.knobs())
  try:
    yield global_sparsity.METHOD
  finally:
    methods.unregister(global_sparsity.METHOD.name)


def test_a_method_in_its_own_file_runs_through_pareto(example_method, tiny_folder, tmp_path,
                                                      capsys):
  """Also: one paired round gives each record a ratio but no interval and no verdict, and
  the run names no fastest method; the budget table has a column per method that ran."""
  folder, _ = tiny_folder("llama_gqa")
  out = tmp_path / "pareto.json"
  run_in_process("pareto", SMALL + [
      "--methods=sparsity,sparsity_global", "--sparsity=0.3", "--global_sparsity=0,0.3",
      "--speed_repeats=1", f"--model={folder}", f"--out={out}",
      f"--bases_dir={tmp_path / 'bases'}"])
  result = json.loads(out.read_text())
  mine = {r["knob"]: r for r in result["records"] if r["method"] == "sparsity_global"}
  assert set(mine) == {"target=0.0", "target=0.3"}
  assert mine["target=0.0"]["ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
  # Every row kept reads dense's bytes and one threshold per site; a target reads fewer.
  assert mine["target=0.0"]["bytes_fraction"] == pytest.approx(1.0, abs=1e-3)
  assert mine["target=0.3"]["bytes_fraction"] < mine["target=0.0"]["bytes_fraction"]
  assert mine["target=0.3"]["tokens_per_s"] > 0  # decoded through its fast path, timed
  assert result["config"]["global_sparsity"] == [0.0, 0.3]
  assert all("sparsity_global_ppl_ratio" in row for row in result["config"]["budgets"])
  assert {key.rsplit("_", 2)[0] for row in result["config"]["budgets"] for key in row
          if key != "budget"} == {"sparsity", "sparsity_global"}
  for r in result["records"]:
    assert (r["rounds"], r["speedup_low"], r["speedup_high"], r["verdict"]) == (
        1, None, None, "too few rounds")
  assert result["config"]["best_measured"] == []
  # Every record is timed beside the faster dense path, chosen in 6 rounds at the start.
  choice, best = result["config"]["best_dense_choice"], result["config"]["best_dense"]
  assert choice["rounds"] == 6 and choice["speedup_low"] <= choice["kept_rows_over_xla"]
  assert best == ("kept_rows_every_row_kept" if choice["verdict"] == "faster" else "xla")
  assert {r["beside"] for r in result["records"]} == {best}
  printed = capsys.readouterr().out
  # No GSI method ran, so no bases were restored or calibrated.
  assert not (tmp_path / "bases").exists() or not any((tmp_path / "bases").iterdir())
  assert "no fastest method per perplexity limit: speed was timed in 1 paired rounds" in printed
  assert "too few rounds" in printed and "ppl_ratio_limit" not in printed


@pytest.mark.parametrize("args, message", [
    (["--methods=sparsity", "--residual_k=16"],
     "--residual_k is a knob of residual, which this run does not evaluate; drop "
     "--residual_k or add it to --methods"),
    (["--methods=gsi", "--sparsity=0.3"],
     "--sparsity is a knob of sparsity, larosa, sparsity+head"),
    (["--methods=sparsity", "--learned_sparsity=0.3"], "to --methods (with --learned)"),
    (["--methods=nothing"], "--methods: unknown ['nothing']"),
])
def test_knobs_of_methods_the_run_does_not_evaluate_are_refused(args, message, tmp_path):
  """Before loading: the model path does not exist."""
  with pytest.raises(GSIError, match=re.escape(message)):
    run_in_process("pareto", args + ["--model=/nonexistent/m.gguf", f"--bases_dir={tmp_path}",
                                     f"--out={tmp_path / 'p.json'}"])
  assert not any(tmp_path.iterdir())


def _method(name, points, knobs=()):
  """A test's own method: its points, bytes as sparsity counts them."""
  return methods.Method(name, "a test's method", knobs, points, by_tree(sparse_bytes),
                        KEPT_ROWS)


@pytest.mark.parametrize("name", ["eps", "methods", "k", "out", "v", "flagfile"])
def test_a_knob_named_like_a_script_flag_is_refused(name):
  knob = methods.Knob(name, float, ("0.1",), "clashes")
  with pytest.raises(GSIError, match=re.escape(f"knob --{name} would clash with the flag")):
    methods.register(_method("clashing", lambda ctx: (), (knob,)))
  assert "clashing" not in methods.REGISTRY


LIST_FLAGS = """
import importlib.util, json, sys
sys.argv = ["pareto"]
spec = importlib.util.spec_from_file_location("pareto", "experiments/pareto.py")
spec.loader.exec_module(importlib.util.module_from_spec(spec))
from absl import flags
from gsi_jax import cli, methods
cli.define_process_flags()  # cli.run defines them before parsing
print(json.dumps(sorted(set(flags.FLAGS) - set(methods.knobs()))))
"""


def test_the_taken_flags_are_every_flag_pareto_has_beside_its_knobs():
  """registry.TAKEN_FLAGS is what register() refuses: it must hold each flag of the script
  (absl's help and flagfile flags are special and not listed by FLAGS, so only <=)."""
  proc = subprocess.run([sys.executable, "-c", LIST_FLAGS], capture_output=True, text=True,
                        cwd=ROOT, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-2000:]
  flags_of_pareto = set(json.loads(proc.stdout.splitlines()[-1]))
  assert {"eps", "methods", "learned", "coordinator_address", "verbosity"} <= flags_of_pareto
  assert flags_of_pareto <= methods.TAKEN_FLAGS
  assert not methods.TAKEN_FLAGS & set(methods.knobs())


def test_a_learned_method_needs_learned_and_brings_its_uniform_method(tmp_path):
  """Named alone without --learned it is refused before loading; with --learned its uniform
  method runs beside it (it is compared with it)."""
  with pytest.raises(GSIError, match=re.escape(
      "--methods sparsity_learned: a learned allocation runs with --learned (beside its "
      "uniform method, sparsity); add --learned")):
    run_in_process("pareto", ["--methods=sparsity_learned", "--model=/nonexistent/m.gguf",
                              f"--out={tmp_path / 'p.json'}"])
  pareto = experiment_module("pareto")
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["pareto", "--methods=sparsity_learned,gsi", "--learned",
               f"--out={tmp_path / 'p.json'}"])
  try:
    c = pareto.config_from_flags()
  finally:
    flags.FLAGS.unparse_flags()
  assert c.running() == ["gsi", "sparsity", "sparsity_learned", "gsi_learned"]
  assert not any(tmp_path.iterdir())


def _nan_points(ctx):
  """One point whose weights are NaN: every score it gets is NaN."""
  yield methods.Point("poisoned", jax.tree.map(lambda a: a * jnp.nan, ctx.base))


@pytest.mark.parametrize("name, points, message", [
    ("empty_method", lambda ctx: iter(()), "method empty_method makes no point with these "
     "settings (its knobs: none, and --k); give its knobs values, or drop empty_method from "
     "--methods"),
    ("nan_method", _nan_points, "method nan_method, point poisoned: its held-out perplexity "
     "ratio is nan, not a finite number, so the run ends with no record for it"),
])
def test_a_named_method_without_a_finite_record_ends_the_run(tiny_folder, tmp_path, name,
                                                             points, message):
  """A method asked for by name that makes no record, or a record whose scores are NaN,
  ends the run with one error and writes no JSON (not an empty or NaN-fed table)."""
  methods.register(_method(name, points))
  try:
    with pytest.raises(GSIError, match=re.escape(message)):
      run_in_process("pareto", SMALL + [
          f"--methods={name}", "--speed_repeats=0", f"--model={tiny_folder('llama_gqa')[0]}",
          f"--out={tmp_path / 'p.json'}", f"--bases_dir={tmp_path / 'bases'}"])
  finally:
    methods.unregister(name)
  assert not (tmp_path / "p.json").exists()


def test_a_method_the_model_cannot_serve_by_name_is_refused(tiny_folder, tmp_path):
  """head runs only with --head_k > 0: named with --head_k=0 it would make no record."""
  with pytest.raises(GSIError, match="method head makes no point with these settings"):
    run_in_process("pareto", SMALL + [
        "--methods=head", "--head_k=0", "--speed_repeats=0",
        f"--model={tiny_folder('llama_gqa')[0]}", f"--out={tmp_path / 'p.json'}",
        f"--bases_dir={tmp_path / 'bases'}"])
  assert not (tmp_path / "p.json").exists()


NAN_AT_SECOND_POINT = '''
import runpy, sys
import jax, jax.numpy as jnp
from gsi_jax import methods
from gsi_jax.methods.common import KEPT_ROWS, by_tree, sparse_bytes

def points(ctx):
  yield methods.Point("clean", ctx.base)
  yield methods.Point("poisoned", jax.tree.map(lambda a: a * jnp.nan, ctx.base))

methods.register(methods.Method("nan_second", "a test's method", (), points,
                                by_tree(sparse_bytes), KEPT_ROWS))
sys.argv = ["pareto.py", *sys.argv[1:]]
runpy.run_path(sys.argv.pop(1), run_name="__main__")
'''


def test_a_nan_partway_keeps_the_finished_records_and_says_where(tiny_folder, tmp_path):
  """The sweep's second point scores NaN: the run exits 2 with one error line that names
  the point and where the first point's record went, marked incomplete; --out itself (an
  earlier run's result) is left as it was."""
  driver = tmp_path / "driver.py"
  driver.write_text(NAN_AT_SECOND_POINT)
  out = tmp_path / "p.json"
  out.write_text('{"an": "earlier run"}\n')
  proc = subprocess.run(
      [sys.executable, str(driver), os.path.join(ROOT, "experiments", "pareto.py"), *SMALL,
       "--methods=nan_second", "--speed_repeats=0", f"--model={tiny_folder('llama_gqa')[0]}",
       f"--out={out}", f"--bases_dir={tmp_path / 'bases'}"],
      capture_output=True, text=True, cwd=ROOT, timeout=600)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  partial = tmp_path / "p.partial.json"
  assert errors[0] == (
      "error: method nan_second, point poisoned: its held-out perplexity ratio is nan, not a "
      "finite number, so the run ends with no record for it; it came from "
      "gsi_jax.metrics.score on the point's tree (check its weights, thresholds or bases for "
      f'NaN or inf); the 1 records finished before it are in {partial} ("complete": false)')
  result = json.loads(partial.read_text())
  assert result["complete"] is False and "point poisoned" in result["stopped"]
  assert [(r["method"], r["knob"]) for r in result["records"]] == [("nan_second", "clean")]
  assert result["records"][0]["ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
  assert json.loads(out.read_text()) == {"an": "earlier run"}


def nan_bytes(params):
  del params
  return lambda scores: float("nan")


def test_a_non_finite_byte_count_names_the_methods_bytes_function(tiny_folder, tmp_path):
  """The bytes function is at fault here, not the tree, and the error says so."""
  def points(ctx):
    yield methods.Point("clean", ctx.base)
  methods.register(methods.Method("nan_bytes", "a test's method", (), points,
                                  by_tree(nan_bytes), KEPT_ROWS))
  try:
    with pytest.raises(GSIError, match=re.escape(
        "its held-out bytes per token is nan, not a finite number, so the run ends with no "
        "record for it; it came from the method's bytes function, "
        "by_tree(tests.test_methods.nan_bytes); no record had finished")):
      run_in_process("pareto", SMALL + [
          "--methods=nan_bytes", "--speed_repeats=0", f"--model={tiny_folder('llama_gqa')[0]}",
          f"--out={tmp_path / 'p.json'}", f"--bases_dir={tmp_path / 'bases'}"])
  finally:
    methods.unregister("nan_bytes")
  assert not (tmp_path / "p.json").exists() and not (tmp_path / "p.partial.json").exists()
