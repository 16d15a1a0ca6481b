"""Every experiment script end to end on tiny GPT-2, GPT-J and OPT checkpoints, with the
values of its records checked; bad flags fail before any compute with one line."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time

import jax
import pytest
from absl import flags

from gsi_jax import cli, methods
from gsi_jax.errors import GSIError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["quality_table", "speedup_table", "generation_fidelity", "negative_control",
           "depth_coherence", "calibration_cost", "storage_overhead", "theorem4_check", "pareto"]
EXTRA = {"pareto": ["--svd_ranks=4", "--sparsity=0.3", "--k=4", "--eps=0.6", "--output_sketch=4",
                    "--ladder=2", "--head_k=4", "--head_eps=0.5", "--learned",
                    "--learned_sparsity=0.3", "--learned_eps=0.6", "--learned_steps=2",
                    "--residual_k=2,4", "--residual_sparsity=0.3", "--rsparse_ranks=2",
                    "--rsparse_sparsity=0.3", "--rsparse_recipe_sparsity=0.3",
                    "--rsparse_alpha=0.5,1", "--rsparse_search_population=3",
                    "--rsparse_search_parents=2", "--rsparse_search_generations=1",
                    "--rsparse_search_windows=2", "--learned_residual_k=2", "--learned_rank_max=4",
                    "--greedy_sparsity=0.3",
                    "--greedy_step=0.1", "--speed_repeats=1"]}
SMALL = ["--calib_tokens=256", "--eval_tokens=128", "--seq_len=32", "--k=4,8",
         "--eps=0,0.3,0.6", "--max_new_tokens=5", "--mode=gated,static"]

_MODULES = {}


def experiment_module(script):
  """experiments/{script}.py, imported once per process (its flags are defined once)."""
  if script not in _MODULES:
    spec = importlib.util.spec_from_file_location(script, os.path.join(ROOT, "experiments",
                                                                       script + ".py"))
    _MODULES[script] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(_MODULES[script])
  return _MODULES[script]


def run_in_process(script, argv):
  module = experiment_module(script)
  flags.FLAGS.unparse_flags()
  flags.FLAGS([script] + argv)
  try:
    module.main([script])
  finally:
    flags.FLAGS.unparse_flags()


def share(v):
  return v is None or 0.0 <= v <= 1.0


def check_quality_table(records):
  for r in records:
    assert share(r["fast_share"]) and all(share(v) for v in r["fast_share_by_site"].values())
    assert share(r["top1_agreement"]) and r["ppl"] > 0
    if r["mode"] == "static":
      assert r["fast_share"] == 1.0
    if r["mode"] == "gated" and r["eps"] == 0:  # never fast: exactly dense
      assert r["fast_share"] == 0 and r["top1_agreement"] == 1.0
      assert r["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)
  static = sorted((r for r in records if r["mode"] == "static"), key=lambda r: r["k"])
  assert [r["speedup_bytes"] for r in static] == sorted(r["speedup_bytes"] for r in static)[::-1]


def check_speedup_table(records):
  for r in records:
    assert share(r["fast_share"]) and r["bytes_per_token"] > 0
  never = sorted((r for r in records if r["eps"] == 0), key=lambda r: r["k"])
  assert all(r["fast_share"] == 0 for r in never)
  # Always slow, a larger k reads more of V_k on top of W.
  assert [r["bytes_per_token"] for r in never] == sorted(r["bytes_per_token"] for r in never)
  assert never[0]["bytes_per_token"] > never[0]["bytes_per_token_dense"]


def check_generation_fidelity(records):
  for r in records:
    assert share(r["fast_share"]) and 1 <= r["gsi_tokens"] <= r["max_new_tokens"]
    assert r["identical"] == (r["first_divergence"] is None)
    if r["eps"] == 0:  # never fast: the dense tokens
      assert r["identical"]


def check_negative_control(records):
  for r in records:
    assert share(r["fast_share"]) and 0 <= r["generations_identical"] <= r["prompts"]
    if r["mode"] == "static":
      assert r["fast_share"] == 1.0
    if r["mode"] == "gated" and r["eps"] == 0:
      assert r["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)
      assert r["generations_identical"] == r["prompts"]


def check_depth_coherence(records):
  assert all(0 <= r["mean_cosine"] <= 1 + 1e-9 for r in records)


def check_calibration_cost(records):
  for r in records:
    assert r["eigh_s"] >= 0 and r["cascade_s"] >= 0 and r["energy_deficit"] > -1e-6


def check_storage_overhead(records):
  ours = sorted((r for r in records if r["dtype"] == "float32"), key=lambda r: r["k"])
  assert all(r["overhead"] > 0 for r in ours)
  assert [r["added_params"] for r in ours] == sorted(r["added_params"] for r in ours)
  for r in records:  # MB are 10^6 bytes of the record's dtype
    itemsize = 4 if r["dtype"] == "float32" else 2
    assert r["added_mb"] == pytest.approx(r["added_params"] * itemsize / 1e6)
    assert r["model_mb"] == pytest.approx(r["model_params"] * itemsize / 1e6)
  gptj = {r["k"]: r for r in records if r["model"] == "gptj-6b"}
  assert gptj, "the GPT-J rows are missing"
  for k, r in gptj.items():  # V_k (d x k) and M (k x O) per site: linear in k below d = 4096
    assert r["model_params"] == pytest.approx(6.05e9, rel=0.01)
    assert r["added_params"] == pytest.approx(k * gptj[min(gptj)]["added_params"] / min(gptj))
    assert r["overhead"] == pytest.approx(r["added_params"] / r["model_params"])


def check_theorem4_check(records):
  for r in records:
    assert r["violations"] == 0
    if r["fast_map_tokens"]:
      assert 0 < r["max_error_over_bound"] <= 1


def check_pareto(records):
  # Every method; CATS only on a gated MLP (test_pareto_cats_on_a_gated_mlp), so not on GPT-2.
  assert {r["method"] for r in records} == set(methods.names()) - {"cats"}
  for r in records:
    assert r["bytes_per_token"] > 0 and share(r["top1_agreement"]) and share(r["fast_share"])
    assert r["tokens_per_s"] > 0 and r["dense_tokens_per_s"] > 0  # dense timed beside it
    # One paired round: its ratio is the median, with no interval and no verdict.
    assert r["measured_speedup"] == pytest.approx(r["tokens_per_s"] / r["dense_tokens_per_s"])
    assert r["speedup_low"] is None and r["speedup_high"] is None and r["rounds"] == 1
    assert r["verdict"] == "too few rounds"
    # Where the sweep's time went: building the point, then each phase of its record.
    assert set(r["phase_s"]) == {"score", "generations", "timed_decode"}
    assert min(r["phase_s"].values()) > 0 and r["build_s"] >= 0
    if r["method"] == "static":
      assert r["fast_share"] == 1.0
    if r["method"] in ("sparsity_learned", "gsi_learned", "residual_learned",
                       "residual_rank_learned"):
      sites = {(layer, site) for layer, s in r["allocation"].items() for site in s}
      assert sites == {(layer, site) for layer, s in r["fast_share_by_layer" if r["method"]
                       == "gsi_learned" else "kept_share_by_layer"].items() for site in s}
      assert all(v > 0 for s in r["allocation"].values() for v in s.values())
      assert len(r["learning"]) == 2 and "uniform_ppl_ratio_at_bytes" in r
      assert r["fallback"] == (r["calib_nll_learned"] > r["calib_nll_uniform"])
    if r["method"] == "residual_rank_learned":  # a rank per site, from 2 up to 4
      assert set(r["ranks"]) == set(r["allocation"])
      ranks = [k for sites in r["ranks"].values() for k in sites.values()]
      assert all(0 <= k <= 4 for k in ranks) and (not r["fallback"] or set(ranks) == {2})
    if r["method"] == "rsparse" and r["knob"] == "s=0.3,alpha=1.0":  # rank 0: padding adds 0
      assert r["calib_nll_padded"] == pytest.approx(r["calib_nll"], abs=1e-6)
    if r["method"] == "rsparse_searched":  # from the better of alpha 0.5 and 1 on calibration
      start = min((u for u in records if u["knob"] in ("s=0.3,alpha=0.5", "s=0.3,alpha=1.0")),
                  key=lambda u: u["calib_nll"])
      assert r["start_alpha"] == float(start["knob"].split("=")[-1])
      assert r["calib_nll_uniform"] == start["calib_nll"]
      assert r["fallback"] == (r["calib_nll_searched"] > r["calib_nll_uniform"])
      assert len(r["search"]) == 2 and "uniform_ppl_ratio_at_bytes" in r
      alphas = [a for s in r["allocation"].values() for a in s.values()]
      assert all(0 <= a <= 1 for a in alphas) and (not r["fallback"] or set(alphas) ==
                                                   {r["start_alpha"]})
      assert r["fallback"] or r["allocation"] == r["searched_allocation"]
      assert r["search"][-1]["best"] <= r["search"][0]["start"]
    if r["method"] == "sparsity_greedy":
      assert set(r["allocation"]) == set(r["kept_share_by_layer"])
      assert all(0 <= v < 1 for s in r["allocation"].values() for v in s.values())
      assert "uniform_ppl_ratio_at_bytes" in r



# Scripts that only drive the model's API above its sites (Pareto's sweep takes ~4 minutes)
# run on one family; those whose records are per family (calibration and gating of each
# site, decoding with each cache, each map's bound) run on all three.
PER_FAMILY = ("quality_table", "generation_fidelity", "theorem4_check")


@pytest.mark.parametrize("script, family", [
    pytest.param(script, family, marks=[pytest.mark.long] if script == "pareto" else [])
    for script in SCRIPTS for family in ("gpt2", "gptj", "opt")
    if script in PER_FAMILY or family == "gpt2"])
def test_script_end_to_end(tiny_folder, tmp_path, family, script, capsys):
  folder, _ = tiny_folder(family)
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("def main():\nclass A:\n")
  out = tmp_path / "sub" / f"{script}.json"  # the folder is created
  run_in_process(script, SMALL + EXTRA.get(script, []) + [f"--model={folder}", f"--out={out}",
                                  f"--bases_dir={tmp_path / 'bases'}",
                                  f"--prompts_file={prompts}"])
  result = json.loads(out.read_text())
  assert result["config"]["model"] == folder
  assert result["records"], "no records"
  globals()[f"check_{script}"](result["records"])
  assert (tmp_path / "sub" / f"{script}.md").exists()
  if script == "depth_coherence":  # per-layer rows to the files, the summary to the terminal
    printed = capsys.readouterr().out
    assert "mean_over_layers" in printed and "next_layer" not in printed
    assert f"{len(result['records'])} rows: {tmp_path / 'sub' / script}.md" in printed
    assert "next_layer" in (tmp_path / "sub" / f"{script}.md").read_text()


def test_pareto_cats_on_a_gated_mlp(tiny_folder, tmp_path):
  """CATS beside sparsity on a tiny Llama: its kept share follows the target, and
  target 0 keeps every channel (dense quality, dense bytes but the gate's threshold)."""
  folder, _ = tiny_folder("llama_gqa")
  out = tmp_path / "pareto.json"
  run_in_process("pareto", SMALL + ["--methods=sparsity,cats", "--sparsity=0.3",
                                    "--cats_sparsity=0,0.5", "--speed_repeats=1",
                                    f"--model={folder}", f"--out={out}",
                                    f"--bases_dir={tmp_path / 'bases'}"])
  records = {r["knob"]: r for r in json.loads(out.read_text())["records"]
             if r["method"] == "cats"}
  assert set(records) == {"target=0.0", "target=0.5"}
  assert records["target=0.0"]["ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
  assert records["target=0.0"]["generations_identical"] == records["target=0.0"]["prompts"]
  assert records["target=0.0"]["bytes_fraction"] == pytest.approx(1.0, abs=1e-3)
  assert records["target=0.5"]["bytes_fraction"] < records["target=0.0"]["bytes_fraction"]
  assert records["target=0.5"]["tokens_per_s"] > 0


def test_pareto_cats_needs_a_gated_mlp_before_calibration(tiny_folder, tmp_path):
  folder, _ = tiny_folder("gpt2")
  proc = run_script([f"--model={folder}", "--methods=cats", "--k=8", "--seq_len=32",
                     f"--bases_dir={tmp_path}",
                     f"--out={tmp_path / 'p.json'}"], "pareto.py")
  assert_one_error_line(proc, "--methods cats needs a gated MLP")
  assert not any(tmp_path.iterdir())  # nothing was calibrated


@pytest.mark.parametrize("bad, message", [
    (["--rsparse_alpha=1.5"], "--rsparse_alpha values must lie in [0, 1]"),
    (["--rsparse_recipe_sparsity=1"], "--rsparse_recipe_sparsity targets must lie in [0, 1)"),
    (["--rsparse_search_parents=8"], "needs 2 <= parents < population"),
    (["--rsparse_search_windows=0"], "search windows must be >= 1"),
    (["--methods=rsparse_searched", "--rsparse_alpha="], "give at least one"),
])
def test_pareto_rsparse_flags_fail_before_loading(bad, message, tmp_path):
  """In process (test_bad_flags_exit_2_with_one_line checks the CLI's one error line): the
  model path does not exist, so a check that ran after loading would fail on that instead."""
  with pytest.raises(GSIError, match=re.escape(message)):
    run_in_process("pareto", bad + ["--model=/nonexistent/m.gguf", f"--bases_dir={tmp_path}",
                                    f"--out={tmp_path / 'p.json'}"])
  assert not any(tmp_path.iterdir())


def run_script(args, script="quality_table.py", cwd=ROOT, folder="experiments"):
  return subprocess.run([sys.executable, os.path.join(ROOT, folder, script)] + args,
                        capture_output=True, text=True, cwd=cwd,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)


def assert_one_error_line(proc, message):
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("bad, message", [
    (["--k=abc"], "--k must be a comma list of numbers"),
    (["--k=0"], "--k values must be positive"),
    (["--eps=-1"], "--eps values must be a number >= 0"),
    (["--eps=nan"], "--eps values must be a number >= 0"),
    (["--mode=fast"], "--mode 'fast' is not one of"),
    (["--impl=cuda"], "--impl 'cuda' is not one of"),
    (["--method=svd"], "--method 'svd' is not one of"),
    (["--dtype=int8"], "--dtype 'int8' is not one of"),
    (["--no_such_flag=1"], "Unknown command line flag"),
    (["--model=/nonexistent/model.gguf"], "no such file or folder"),
    (["--calib_tokens=-1"], "--calib_tokens must be at least one window"),
    (["--eval_tokens=0"], "--eval_tokens must be at least one window"),
    (["--seq_len=1"], "--seq_len must be >= 2"),
    (["--max_new_tokens=0"], "--max_new_tokens must be a positive whole number"),
    (["--calib_text_file=/nonexistent.txt"], "--calib_text_file: text file not found"),
    (["--eval_text_file=/"], "--eval_text_file: / is a folder"),
    (["--out=/"], "--out: / is a folder"),
    (["--out=/etc/hostname/x.json"], "is a file, so"),
    (["--bases_dir=/etc/hostname/bases"], "cannot save bases under"),
    (["--out=/proc/x.json"], "is not writable"),  # permissions say yes to root; a try says no
    (["--bases_dir=/proc/bases"], "is not writable"),
    (["positional"], "unexpected arguments"),
])
def test_bad_flags_exit_2_with_one_line(bad, message):
  assert_one_error_line(run_script(bad), message)


def test_checks_that_need_the_model_come_before_calibration(tiny_folder, tmp_path):
  folder, _ = tiny_folder("gpt2")
  proc = run_script([f"--model={folder}", "--k=10000", f"--bases_dir={tmp_path}"])
  assert_one_error_line(proc, "--k=10000 exceeds the widest site")
  assert not any(tmp_path.iterdir())  # nothing was calibrated
  empty = tmp_path / "empty.txt"
  empty.write_text("\n \n")
  proc = run_script([f"--model={folder}", f"--prompts_file={empty}"], "generation_fidelity.py")
  assert_one_error_line(proc, "--prompts_file")
  short = tmp_path / "short.txt"
  short.write_text("a few words of text, " * 10)
  proc = run_script([f"--model={folder}", f"--calib_text_file={short}", f"--bases_dir={tmp_path}", "--k=8",
                     "--calib_tokens=4096", "--seq_len=32"])
  assert_one_error_line(proc, f"--calib_tokens=4096, but {short} holds only 192 tokens")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "short.txt"]  # no calibration


def run_decode_benchmark(args):
  return run_script(["--torch=false"] + args, "decode.py", folder="benchmarks")


@pytest.mark.parametrize("bad, message", [
    (["--gsi=256"], "--gsi takes k:eps pairs"),
    (["--gsi=0:0.1"], "--gsi k must be a positive whole number"),
    (["--gsi=8:-1"], "--gsi eps must be a number >= 0"),
    (["--gsi=8:0.1,8:0.1"], "--gsi repeats a point"),
    (["--prompt= "], "--prompt is empty"),
    (["--repeats=0"], "--repeats must be a positive whole number"),
    (["--ceiling_gib=-1"], "--ceiling_gib (0: sized from the cache) must be a finite number in "
                           "[0, 1024]"),
    (["--ceiling_gib=inf"], "--ceiling_gib (0: sized from the cache) must be a finite number"),
    (["--ceiling_gib=1000"], "--ceiling_gib: the read ceiling's"),
])
def test_decode_benchmark_checks_flags_before_loading(bad, message):
  # A model path that does not exist: a flag check that ran after loading would say so instead.
  assert_one_error_line(run_decode_benchmark(bad + ["--model=/nonexistent/m.gguf"]), message)


@pytest.mark.parametrize("bad, message", [
    (["--gsi=10000:0.1"], "--gsi k=10000 exceeds the widest site"),
    (["--max_new_tokens=100"], "--prompt plus --max_new_tokens of"),
    (["--cats_all"], "CATS needs a gated MLP"),
])
def test_decode_benchmark_checks_the_model_before_timing(tiny_folder, tmp_path, bad, message):
  folder, _ = tiny_folder("gpt2")
  out = tmp_path / "decode.json"
  proc = run_decode_benchmark(bad + [f"--model={folder}", "--prompt=ab", f"--out={out}",
                                     f"--bases_dir={tmp_path / 'bases'}"])
  assert_one_error_line(proc, message)
  assert "JAX dense" not in proc.stderr and not out.exists()


def test_decode_benchmark_times_points_beside_dense_and_profiles_them(tiny_folder, tmp_path):
  folder, _ = tiny_folder("llama_gqa")
  out = tmp_path / "decode.json"
  proc = run_decode_benchmark([f"--model={folder}", "--prompt=abc", "--max_new_tokens=4",
                               "--repeats=3", "--gsi=8:0.1", "--kept_all", "--cats_all",
                               "--profile", "--ceiling_gib=0.0625",
                               f"--bases_dir={tmp_path / 'bases'}", f"--out={out}"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  # The read ceiling measured in the run, and dense's share of it.
  ceiling = r["read_ceiling"]
  assert ceiling["bytes"] == 2**26 and r["read_ceiling_gb_s"] == max(
      ceiling["reduce_gb_s"], ceiling["copy_gb_s"]) > 0
  assert r["dense_gb_s"] == pytest.approx(r["dense_bytes_per_token"]
                                          * r["jax_dense_tokens_per_s"] / 1e9)
  assert r["dense_of_read_ceiling"] == pytest.approx(r["dense_gb_s"] / r["read_ceiling_gb_s"])
  # GSI is timed beside the faster dense path: every row kept where its interval says so.
  assert r["best_dense"] == ("kept_rows_every_row_kept" if r["kept_all"]["verdict"] == "faster"
                             else "xla")
  assert r["gsi"][0]["beside"] == r["best_dense"]
  # The choice of dense takes 6 rounds at least (a 95% interval); the points --repeats.
  for point, rounds in ((r["gsi"][0], 3), (r["kept_all"], 6), (r["cats_all"], 3)):
    assert point["speedup_low"] <= point["measured_speedup"] <= point["speedup_high"]
    assert point["rounds"] == rounds and point["tokens_per_s"] > 0
    assert point["dense_tokens_per_s"] > 0
  profiles = (r["dense_profile"], r["gsi"][0]["profile"], r["kept_all"]["profile"],
              r["cats_all"]["profile"])
  # Dense runs no conditional; GSI at eps > 0 one at each of its 8 sites a token, the switch
  # on the gate: the decode knows every eps > 0, so no site branches on it (decode_gate).
  assert [p["conditionals_per_token"] for p in profiles[:2]] == [0, 8]
  assert profiles[1]["conditional_own_ms_per_token"] > 0
  for profile in profiles:
    assert profile["per_op_events"] and profile["ops_per_token"] > 0
    ranked = [op["ms_per_token"] for op in profile["top_ops"]]
    assert ranked == sorted(ranked, reverse=True) and len(ranked) <= 12
    assert sum(ranked) <= (profile["dot_ms_per_token"] + profile["custom_call_ms_per_token"]
                           + profile["other_ms_per_token"]) * (1 + 1e-9)


def test_help_exits_0():
  proc = run_script(["--help"])
  assert proc.returncode == 0 and "--eval_tokens" in proc.stdout


def test_demo_validates_before_compute(tmp_path):
  for args, message in ((["--k=128,256"], "one --k and one --eps"),
                        (["--max_new_tokens=-3"], "--max_new_tokens must be"),
                        ([f"--out={tmp_path}"], "is a folder")):
    proc = subprocess.run([sys.executable, "-m", "gsi_jax.demo"] + args, capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          timeout=300)
    assert_one_error_line(proc, message)


def test_demo_times_gsi_beside_dense_with_an_interval(tiny_folder, tmp_path):
  folder, _ = tiny_folder("llama_gqa")
  out = tmp_path / "demo.json"
  proc = subprocess.run([sys.executable, "-m", "gsi_jax.demo", f"--model={folder}", "--k=8",
                         "--eps=0.1", "--calib_tokens=256", "--eval_tokens=128", "--seq_len=32",
                         "--max_new_tokens=4", "--prompt=abc", f"--bases_dir={tmp_path / 'b'}",
                         f"--out={out}"], capture_output=True, text=True, cwd=ROOT,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert r["speedup_low"] <= r["measured_speedup"] <= r["speedup_high"]
  assert r["rounds"] == 7 and r["verdict"] in ("faster", "slower", "within noise")
  assert r["best_dense_choice"]["rounds"] == 7 and r["best_dense"] == (
      "kept_rows_every_row_kept" if r["best_dense_choice"]["verdict"] == "faster" else "xla")
  assert f"dense ({r['best_dense']})" in proc.stdout and "running on cpu: 1 x cpu" in proc.stderr
  assert r["measured_speedup"] == pytest.approx(
      r["gsi_tokens_per_s"] / r["dense_tokens_per_s"], rel=0.5)
  assert f"over 7 paired rounds ({r['verdict']})" in proc.stdout


def test_strict_json_never_writes_bare_infinity(tmp_path):
  from gsi_jax import experiment
  path = experiment.write_json(str(tmp_path / "x.json"), {"eps": math.inf, "v": [math.nan, 1.0]})
  text = (tmp_path / "x.json").read_text()
  assert "Infinity" not in text and "NaN" not in text
  result = json.loads(text)
  run = result.pop("run")
  assert result == {"eps": "inf", "v": ["nan", 1.0]} and path.endswith("x.json")
  # Every result names its machine and how long its process had run when it was written.
  assert 0 < run["wall_s"] < 24 * 3600 and run["cpus"] == os.cpu_count()
  assert 0 < run["cpu_s"] <= run["wall_s"] * os.cpu_count()
  assert run["cpu"] and run["backend"] == "cpu" and run["jax"] == jax.__version__


def test_results_cost_lists_the_json_a_run_wrote(tmp_path):
  """tools/results_cost.py: the run's wall time, and each JSON written since it started
  with the wall and CPU time that JSON records; older JSON is left out; the CPU time over the
  cores is the floor no packing of the steps beats."""
  results = tmp_path / "results"
  results.mkdir()
  started = time.time() - 100
  (results / "old.json").write_text(json.dumps({"run": {"wall_s": 5.0}}))
  os.utime(results / "old.json", (started - 10, started - 10))
  (results / "new.json").write_text(json.dumps({"records": [], "run": {"wall_s": 42.0,
                                                                       "cpu_s": 63.0}}))
  out = tmp_path / "cost.json"
  proc = run_script([f"--started={started}", f"--results_dir={results}", f"--out={out}"],
                    script="results_cost.py", folder="tools")
  assert proc.returncode == 0, proc.stderr[-2000:]
  cost = json.loads(out.read_text())
  assert [(r["json"], r["wall_s"]) for r in cost["records"]] == [("new.json", 42.0)]
  assert 0 < cost["records"][0]["written_after_s"] <= cost["wall_s"]
  assert 100 <= cost["wall_s"] < 400 and cost["wall_min"] == pytest.approx(cost["wall_s"] / 60)
  assert cost["records"][0]["cpu_s"] == 63.0 and cost["cpu_s"] == 63.0
  assert cost["floor_min"] == pytest.approx(63.0 / os.cpu_count() / 60)


@pytest.mark.parametrize("args, message", [
    ([], "--started must be a past epoch second"),
    (["--started=4102444800"], "--started must be a past epoch second"),
    (["--started=1", "--results_dir=/nonexistent"],
     "--results_dir /nonexistent is not a directory"),
    (["--started=1", "--results_dir=tests"], "no JSON under tests was written since --started"),
])
def test_results_cost_bad_flags_exit_2(args, message):
  assert_one_error_line(run_script(args + ["--out=/tmp/unused.json"], script="results_cost.py",
                                   folder="tools"), message)


EXPERIMENTS = sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "experiments"))
                     if name.endswith(".py"))


@pytest.mark.parametrize("script", EXPERIMENTS)
def test_a_bare_run_writes_under_runs_and_only_commit_rewrites_results(script):
  """Run bare, an experiment writes runs/NAME.json (ignored by git), never the committed
  results/NAME.json; --commit writes that, and --out with --commit is refused."""
  import subprocess
  committed = experiment_module(script).OUT
  assert committed.startswith("results/") and committed.endswith(".json")
  flags.FLAGS.unparse_flags()
  try:
    flags.FLAGS([script])
    bare = cli.output_path(committed)
    flags.FLAGS([script, "--commit"])
    assert cli.output_path(committed) == committed
    flags.FLAGS([script, "--commit", "--out=/tmp/x.json"])
    with pytest.raises(GSIError, match="--out and --commit name two places"):
      cli.output_path(committed)
  finally:
    flags.FLAGS.unparse_flags()
  assert bare == os.path.join("runs", committed[len("results/"):])
  for path in (bare, bare[:-5] + ".md", bare[:-5] + ".png"):
    ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
    assert ignored.returncode == 0, f"{path} is not ignored by git"


def test_a_bare_experiment_records_no_path_of_this_machine(tiny_folder, tmp_path, monkeypatch):
  """storage_overhead run without --out from another folder: its JSON lands under that
  folder's runs/, and its config names the bases cache relative to home, not absolutely."""
  (tmp_path / "work").mkdir()
  monkeypatch.chdir(tmp_path / "work")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  bases = tmp_path / "home" / ".cache" / "b"
  run_in_process("storage_overhead", ["--k=4", "--calib_tokens=256", "--seq_len=32",
                                      "--eval_tokens=64", f"--model={tiny_folder('gpt2')[0]}",
                                      f"--bases_dir={bases}"])
  result = json.loads((tmp_path / "work" / "runs" / "storage_overhead.json").read_text())
  assert result["config"]["bases_dir"] == os.path.join("~", ".cache", "b")
  assert result["config"]["out"] == os.path.join("runs", "storage_overhead.json")
  assert str(tmp_path) not in json.dumps(result["config"])


def test_command_line_text_that_is_not_utf8_is_refused_before_loading(tmp_path):
  """Bytes that are not UTF-8 reach Python as surrogates, which no tokenizer encodes."""
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "decode.py"), b"--prompt=caf\xe9 \xff",
       "--model=/nonexistent/m.gguf"], capture_output=True, text=True, cwd=ROOT, timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert_one_error_line(proc, "--prompt is not UTF-8 text")


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe{}", "is not UTF-8 text"),
    (b'{"records": [1, 2]}', "is not a pareto.py JSON"),
    (b'[1, 2]', "is not a pareto.py JSON"),
    (b'{"records": [', "is not JSON"),
])
def test_a_users_json_is_read_strictly(tmp_path, content, message):
  bad = tmp_path / "p.json"
  bad.write_bytes(content)
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "best_dense.py"), f"--pareto={bad}",
       f"--out={tmp_path / 'o.json'}"], capture_output=True, text=True, cwd=ROOT, timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert_one_error_line(proc, message)
  assert not (tmp_path / "o.json").exists()


def test_the_pareto_figure_has_a_legend_and_a_style_a_method(monkeypatch, tmp_path):
  """Untimed records (no speed panel) still get a legend, and no two methods share a marker
  and a colour, however many are registered."""
  from gsi_jax import experiment, methods
  pareto = experiment_module("pareto")
  names = methods.names()
  records = [{"method": name, "bytes_fraction": 0.5 + i / 100, "ppl_ratio": 1.0 + i / 100,
              "top1_agreement": 0.9} for i, name in enumerate(names)]
  figures = []
  monkeypatch.setattr(experiment, "save_figure", lambda fig, out: figures.append(fig))
  pareto.plot(records, str(tmp_path / "pareto.json"))
  (fig,) = figures
  (legend,) = fig.legends
  assert [t.get_text() for t in legend.get_texts()] == list(names)
  lines = {line.get_label(): (line.get_marker(), line.get_color())
           for line in fig.axes[0].get_lines() if line.get_label() in names}
  assert len(set(lines.values())) == len(names) >= 18
