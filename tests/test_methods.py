"""The methods registry: all eighteen methods in it, each declared whole; a method that
exists only in a test, registered from its own file, runs through pareto with no other
change; knobs of methods a run does not evaluate are refused."""

import json
import re

import pytest

from gsi_jax import cli, methods
from gsi_jax.errors import GSIError
from tests import global_sparsity
from tests.test_experiments import SMALL, run_in_process

EIGHTEEN = {"gsi", "gsi_out", "gsi_ladder", "static", "svd", "sparsity", "head", "sparsity+head",
            "larosa", "residual", "rsparse", "cats", "sparsity_greedy", "sparsity_learned",
            "gsi_learned", "residual_learned", "residual_rank_learned", "rsparse_searched"}


def test_the_registry_holds_every_method_declared_whole():
  assert set(methods.names()) == EIGHTEEN
  for name, method in methods.REGISTRY.items():
    assert method.name == name and method.doc and callable(method.points)
    assert set(method.fast_path) == set(methods.PLATFORMS), name
    assert all(isinstance(k, methods.Knob) for k in method.knobs)
    if method.learned:
      assert method.uniform in methods.REGISTRY
  # Allocations (learned, greedy, searched) are compared with their uniform method.
  allocated = {n: m.uniform for n, m in methods.REGISTRY.items() if m.uniform}
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


def test_a_method_in_its_own_file_runs_through_pareto(example_method, tiny_folder, tmp_path):
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
