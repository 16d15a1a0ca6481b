"""Progress lines: no step over EVERY_S is silent, a first item (compiling) included."""

import logging
import time

from gsi_jax import progress


def test_a_slow_first_item_is_said_while_it_runs(caplog):
  caplog.set_level(logging.INFO)
  counter = progress.Counter("scoring 8 tokens", 2, every_s=0.05)
  time.sleep(0.3)  # the first item compiles
  said = [r.getMessage() for r in caplog.records]
  assert any(m.startswith("scoring 8 tokens: 0/2, the first still running after") for m in said)
  counter.advance()
  counter.advance()
  assert caplog.records[-1].getMessage().startswith("scoring 8 tokens: 2/2, done in")


def test_a_quick_loop_says_nothing(caplog):
  caplog.set_level(logging.INFO)
  counter = progress.Counter("quick", 2, every_s=5)
  counter.advance(2)
  time.sleep(0.05)
  counter.close()
  assert not caplog.records


def test_a_step_says_its_start_and_its_time(caplog):
  caplog.set_level(logging.INFO)
  with progress.step("loading m"):
    pass
  said = [r.getMessage() for r in caplog.records]
  assert said[0] == "loading m ..." and said[1].startswith("loading m: done in ")


def test_without_logging_configured_the_lines_go_to_stderr(capsys, caplog):
  """A plain script or a notebook never configured logging: INFO is not shown there."""
  caplog.set_level(logging.WARNING)
  progress.say("calibrating %s", "m")
  assert capsys.readouterr().err == "calibrating m\n" and not caplog.records
  caplog.set_level(logging.INFO)
  progress.say("calibrating %s", "m")
  assert capsys.readouterr().err == "" and caplog.records[-1].getMessage() == "calibrating m"


def test_a_loop_estimates_what_is_left(caplog):
  caplog.set_level(logging.INFO)
  counter = progress.Counter("scoring", 4, every_s=0.0)
  counter.advance()
  assert caplog.records[-1].getMessage().startswith("scoring: 1/4 (25%), ")
  assert caplog.records[-1].getMessage().endswith(" s left")


def test_a_plain_script_shows_calibration_progress(tiny_folder):
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = ("import sys, numpy as np, gsi_jax\n"
            "m = gsi_jax.load_model(sys.argv[1])\n"
            "gsi_jax.calibrate(m, m.params, np.arange(1, 65).reshape(4, 16), 8, seq_len=16)\n")
  proc = subprocess.run([sys.executable, "-c", script, tiny_folder("gpt2")[0]], cwd=root,
                        capture_output=True, text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root})
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "calibration eigh: layer_1 (2/2) in " in proc.stderr
  assert "s left" in proc.stderr


def test_a_long_test_run_says_how_far_it_is_and_what_is_left():
  from types import SimpleNamespace
  from tests.conftest import RunProgress
  lines = []
  reporter = SimpleNamespace(write_line=lines.append, write=lambda text: None)
  config = SimpleNamespace(pluginmanager=SimpleNamespace(getplugin=lambda name: reporter))
  run = RunProgress(config, every_s=0.0)
  run.pytest_xdist_node_collection_finished(None, ["a", "b", "c", "d"])
  for when in ("setup", "call", "teardown"):
    run.pytest_runtest_logreport(SimpleNamespace(when=when))
  assert len(lines) == 1 and lines[0].startswith("tests: 1/4 done in ")
  assert lines[0].endswith(" min left")
