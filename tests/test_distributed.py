"""Several real processes (127.0.0.1, gloo) calibrate, restore and decode as one does.

Each test starts its processes through tests/multiprocess.py, bounds them in time and
stops them by PID.  One process's results are computed here, in the test's own process.
"""

import os
import re
import time

import numpy as np
import pytest

import gsi_jax
from gsi_jax import GSIError
from gsi_jax.runtime.distributed import ProcessConfig
from tests.multiprocess import CALIB, K, PROMPT, launch, reference, start

MODEL = "llama_mha"


def _calibrate_here(model, method):
  return gsi_jax.calibrate(model, model.params, CALIB, K, method=method, seq_len=16,
                           progress=False)


def _assert_all_ok(results):
  for rc, out, err in results:
    assert rc == 0 and "done" in out, err[-3000:]


def _assert_same_as_one_process(out_dir, model, bases, exact=True):
  """Each process's bases against one process's `bases`, and its decode against one
  process's decode with the very bases the processes saved.

  exact (eigh): every vector to 1e-5 of its scale.  Otherwise (the cascade's iterative
  solvers stop at a tolerance, and a reduction split across processes rounds in another
  order) each site's captured energy to 1e-5 of its trace, eigenvalues to 1e-4.
  """
  saved = gsi_jax.load_bases(str(out_dir / "bases"))
  logits, tokens = reference(model, saved)
  for pid in (0, 1):
    got = np.load(out_dir / f"process{pid}.npz")
    assert int(got["devices"]) == 2  # one global mesh over both processes' devices
    for layer, site in bases.sites():
      V, W = bases.vectors[layer][site], got[f"V/{layer}/{site}"]
      np.testing.assert_array_equal(W, saved.vectors[layer][site])
      if exact:
        W = W * np.sign(np.sum(V * W, axis=0))  # an eigenvector's sign is arbitrary
        assert np.abs(V - W).max() <= 1e-5 * np.abs(V).max(), (pid, layer, site)
      else:
        G = _gram(model, layer, site)
        energy = lambda U: np.trace(U.T @ G @ U) / np.trace(G)
        assert abs(energy(V) - energy(W)) <= 1e-5, (pid, layer, site)
        np.testing.assert_allclose(saved.eigenvalues[layer][site],
                                   bases.eigenvalues[layer][site], rtol=1e-4)
    assert np.abs(got["logits"] - logits).max() <= 1e-5 * np.abs(logits).max()
    np.testing.assert_array_equal(got["tokens"], tokens)


_GRAMS = {}


def _gram(model, layer, site):
  if id(model) not in _GRAMS:
    from gsi_jax.gsi import calibration
    _GRAMS[id(model)] = calibration.gram_matrices(model, model.params, CALIB, progress=False)
  return np.asarray(_GRAMS[id(model)][layer][site], np.float64)


@pytest.mark.multiprocess
@pytest.mark.parametrize("method", ["eigh", "cascade"])
def test_two_processes_calibrate_and_decode_as_one(tiny_folder, tmp_path, method):
  folder = tiny_folder(MODEL)[0]
  _assert_all_ok(launch(["--mode=calibrate", f"--model_path={folder}",
                         f"--out_dir={tmp_path}", f"--method={method}"]))
  model = gsi_jax.load_model(folder)
  bases = _calibrate_here(model, method)
  _assert_same_as_one_process(tmp_path, model, bases, exact=method == "eigh")
  # Saved by two processes, restored by one: the same bases, the same model identity.
  restored = gsi_jax.load_bases(str(tmp_path / "bases"))
  assert restored.meta["fingerprint"] == bases.meta["fingerprint"]
  assert restored.meta["text_sha256"] == bases.meta["text_sha256"]


@pytest.mark.multiprocess
def test_two_processes_resume_after_a_crash_and_restore_one_process_bases(tiny_folder,
                                                                         tmp_path):
  folder = tiny_folder(MODEL)[0]
  args = ["--mode=calibrate", f"--model_path={folder}", f"--out_dir={tmp_path}"]
  crashed = launch(args + ["--stop_after_layer=0"])
  assert [rc for rc, _, _ in crashed] == [9, 9], [err[-2000:] for _, _, err in crashed]
  resumed = launch(args)
  _assert_all_ok(resumed)
  for _, _, err in resumed:  # only the layer after the crash is solved again
    assert "calibration resumes after 1 of 2 layers" in err
    assert "layer_0 (1/2)" not in err and "layer_1 (2/2)" in err
  model = gsi_jax.load_model(folder)
  bases = _calibrate_here(model, "eigh")
  _assert_same_as_one_process(tmp_path, model, bases)
  # Saved by one process, restored by two.
  one = tmp_path / "one"
  gsi_jax.save_bases(str(one / "bases"), bases)
  _assert_all_ok(launch(["--mode=restore", f"--model_path={folder}", f"--out_dir={one}"]))
  _assert_same_as_one_process(one, model, bases)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["gpt2", "llama_mha"])  # fused q|k|v columns; (out, in)
def test_each_process_reads_only_its_columns(tiny_folder, tmp_path, family):
  folder = tiny_folder(family)[0]
  _assert_all_ok(launch(["--mode=load", f"--model_path={folder}", f"--out_dir={tmp_path}"]))
  whole = gsi_jax.load_model(folder)
  logits = np.asarray(whole.logits(whole.params, PROMPT))
  for pid in (0, 1):
    got = np.load(tmp_path / f"process{pid}.npz")
    # Half of every split kernel and bias, all of the replicated leaves, nothing more.
    assert int(got["bytes_read"]) == int(got["share"]) < 0.75 * whole.bytes_read
    assert np.abs(got["logits"] - logits).max() <= 1e-5 * np.abs(logits).max()


def _error_lines(err):
  return [line for line in err.splitlines() if line.startswith("error:")]


_LOG = re.compile(r" \(its log: (\S+\.process\d\.log)\)$")


def _one_error_line(err: str) -> tuple[str, str]:
  """The terminal's one `error:` line, without the log it names; and that log's text."""
  (line,) = _error_lines(err)
  log = _LOG.search(line)
  assert log and os.path.isfile(log.group(1)), line
  with open(log.group(1), encoding="utf-8") as f:
    return line[:log.start()], f.read()


def _wait_for(path, text, timeout):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if os.path.exists(path) and text in open(path, encoding="utf-8").read():
      return
    time.sleep(0.2)
  raise AssertionError(f"{text!r} never appeared in {path}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("phase", ["calibration", "save", "decode"])
def test_when_process_0_dies_every_survivor_says_so_in_one_line(tiny_folder, tmp_path, phase):
  """kill -9 of process 0 (the host of the runtime's coordination service) inside a phase:
  jaxlib would abort the survivor with a C++ stack trace; its supervisor says one line."""
  folder = tiny_folder(MODEL)[0]
  timeout_s = 20
  streams = {name: {p: open(tmp_path / f"{name}{p}.txt", "w") for p in (0, 1)}
             for name in ("out", "err")}
  procs = start(["--mode=calibrate", f"--model_path={folder}", f"--out_dir={tmp_path}",
                 f"--process_timeout_s={timeout_s}", f"--hold_at={phase}", "--die_process=0"],
                stdout=streams["out"], stderr=streams["err"])
  try:
    _wait_for(tmp_path / "out0.txt", f"holding at {phase}", 180)
    procs[0].kill()  # the process the user started: its child dies with it
    killed = time.monotonic()
    status = procs[1].wait(timeout=timeout_s + 30)
    took = time.monotonic() - killed
  finally:
    for p in procs.values():
      p.kill()
      p.wait()
  err = (tmp_path / "err1.txt").read_text()
  assert status == 2 and took < timeout_s, (status, took, err[-3000:])
  line, log = _one_error_line(err)
  assert line in (
      "error: process 1 of 2 lost the run's coordinator, process 0: it stopped or cannot be "
      "reached; every process of the run ends",
      "error: another process of this 2-process run went away during a collective (Gloo: "
      "closed by peer); every process of the run ends",
      "error: lost the coordinator (process 0) of this 2-process run (XlaRuntimeError); it "
      "stopped or cannot be reached"), err[-3000:]
  for crash in ("Traceback", "Check failure", "Fatal Python error", ".cc:"):
    assert crash not in err, err[-3000:]
  assert "process 1 of 2: computes, process 0 writes" in err  # the child's own lines reach
  assert "process 1 of 2: computes, process 0 writes" in log  # the terminal and the log
  assert "Check failure" in log or "Gloo" in log  # what the terminal was spared is kept


@pytest.mark.multiprocess
def test_a_peer_that_never_starts_or_dies_ends_the_run_with_one_line(tiny_folder, tmp_path):
  folder = tiny_folder(MODEL)[0]
  args = ["--mode=calibrate", f"--model_path={folder}", "--process_timeout_s=10"]
  (alone,) = launch(args + [f"--out_dir={tmp_path / 'a'}"], skip=(1,), timeout=60)
  assert alone[0] == 2 and _one_error_line(alone[2])[0] == (
      f"error: not every process joined the 2-process run at "
      f"{re.search(r'127.0.0.1:[0-9]+', alone[2]).group()} within 10 s; start each one "
      "with the same --coordinator_address and --num_processes, and its own --process_id"), \
      alone[2][-2000:]
  survivor, dead = launch(args + [f"--out_dir={tmp_path / 'b'}", "--stop_after_layer=0",
                                  "--die_process=1"], timeout=60)
  assert dead[0] == 9
  # Gloo notices the closed connection at the next collective; the watchdog would
  # within --process_timeout_s if no collective were under way.
  line, _ = _one_error_line(survivor[2])
  assert survivor[0] == 2 and line in (
      "error: another process of this 2-process run went away during a collective (Gloo: "
      "closed by peer); every process of the run ends",
      "error: process 1 of 2 stopped answering (nothing from it for 10 s); every process "
      "of the run ends"), survivor[2][-2000:]
  assert "Traceback" not in survivor[2] and "Check failure" not in survivor[2]


@pytest.mark.multiprocess
def test_processes_with_other_flags_are_refused_before_compute(tiny_folder, tmp_path):
  folder = tiny_folder(MODEL)[0]
  results = launch(["--mode=calibrate", f"--model_path={folder}", f"--out_dir={tmp_path}"],
                   extra={1: ["--method=cascade"]})
  for rc, _, err in results:
    assert rc == 2 and _one_error_line(err)[0] == (
        "error: processes [1] were started with another method than process 0; start every "
        "process with the same flags"), err[-2000:]
  assert not os.path.exists(tmp_path / "progress")  # nothing was calibrated


@pytest.mark.parametrize("kw, message", [
    ({"coordinator_address": "localhost"}, "must be host:port"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2},
     "--process_id must be in 0..1"),
    ({"coordinator_address": "h:1"}, "needs --num_processes"),
    ({"num_processes": 2}, "need --coordinator_address"),
    ({"timeout_s": 1}, "--process_timeout_s must be >= 5"),
])
def test_bad_process_settings_are_refused(kw, message):
  with pytest.raises(GSIError, match=message):
    ProcessConfig(**kw)
