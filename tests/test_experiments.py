"""Every experiment script end to end on tiny GPT-2, GPT-J and OPT checkpoints."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from absl import flags


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["quality_table", "speedup_table", "generation_fidelity", "negative_control",
           "depth_coherence", "calibration_cost", "storage_overhead", "theorem4_check", "pareto"]
REQUIRED = {
    "quality_table": {"k", "eps", "mode", "ppl_dense", "ppl", "ppl_ratio", "top1_agreement",
                      "fast_share", "fast_share_by_site", "speedup_paper", "speedup_bytes",
                      "calib_tokens", "eval_tokens"},
    "generation_fidelity": {"prompt", "dense_text", "gsi_text", "identical",
                            "first_divergence", "fast_share"},
    "pareto": {"method", "knob", "bytes_per_token", "bytes_fraction", "ppl_ratio",
               "top1_agreement"},
}
EXTRA = {"pareto": ["--svd_ranks=4", "--sparsity=0.3", "--k=4", "--eps=0.6", "--output_sketch=4",
                    "--ladder=2", "--head_k=4", "--head_eps=0.5"]}
SMALL = ["--calib_tokens=256", "--eval_tokens=128", "--seq_len=32", "--k=4,8",
         "--eps=0.3,0.6", "--max_new_tokens=5", "--mode=gated,static"]


_MODULES = {}


def run_in_process(script, argv):
  if script not in _MODULES:  # a script's own flags may be defined once only
    spec = importlib.util.spec_from_file_location(script, os.path.join(ROOT, "experiments",
                                                                       script + ".py"))
    _MODULES[script] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(_MODULES[script])
  module = _MODULES[script]
  flags.FLAGS.unparse_flags()
  flags.FLAGS([script] + argv)
  try:
    module.main([script])
  finally:
    flags.FLAGS.unparse_flags()


@pytest.mark.parametrize("family", ["gpt2", "gptj", "opt"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_script_end_to_end(tiny_folder, tmp_path, family, script):
  folder, _ = tiny_folder(family)
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("def main():\nclass A:\n")
  out = tmp_path / f"{script}.json"
  run_in_process(script, SMALL + EXTRA.get(script, []) + [f"--model={folder}", f"--out={out}",
                                  f"--bases_dir={tmp_path / 'bases'}",
                                  f"--prompts_file={prompts}"])
  result = json.loads(out.read_text())
  assert result["config"]["model"] == folder
  assert result["records"], "no records"
  for record in result["records"]:
    assert REQUIRED.get(script, set()) <= set(record)
  if script == "pareto":  # every method and extension ran
    assert {r["method"] for r in result["records"]} == set(_MODULES[script].METHODS)
  assert (tmp_path / f"{script}.md").exists()


@pytest.mark.parametrize("bad, message", [
    (["--k=abc"], "--k must be a comma list of numbers"),
    (["--eps=-1"], "--eps values must be >= 0"),
    (["--mode=fast"], "--mode 'fast' is not one of"),
    (["--no_such_flag=1"], "Unknown command line flag"),
    (["--model=/nonexistent/model.gguf"], "no such file or folder"),
])
def test_bad_flags_exit_2_with_one_line(bad, message):
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "quality_table.py")]
                        + bad, capture_output=True, text=True, cwd=ROOT,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 2, proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and message in lines[0], proc.stderr
  assert "Traceback" not in proc.stderr
