"""A run of several processes at its edges, with real processes on 127.0.0.1: a coordinator
port that another program holds, two processes given one --process_id, processes given
different --num_processes, and a run stopped by SIGTERM or Ctrl-C through its launcher
or supervisor.  Each ends every process with one line and writes nothing."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from gsi_jax.runtime.distributed import coordinator_port
from tests.multiprocess import ROOT, launch, start

pytestmark = pytest.mark.multiprocess
MODEL = "llama_mha"
TIMEOUT = "--process_timeout_s=5"


def _errors(err: str) -> list[str]:
  return [line for line in err.splitlines() if line.startswith(("error:", "interrupted:"))]


def _without_log(line: str) -> str:
  return re.sub(r" \(its log: \S+\)$", "", line)


def _load_args(tiny_folder, tmp_path):
  return ["--mode=load", f"--model_path={tiny_folder(MODEL)[0]}", f"--out_dir={tmp_path}",
          TIMEOUT]


def test_a_coordinator_port_in_use_is_one_line_naming_it(tiny_folder, tmp_path):
  port = coordinator_port()
  with socket.socket() as holder:  # another program listens on the port
    holder.bind(("127.0.0.1", port))
    holder.listen()
    (rc, _, err), = launch(_load_args(tiny_folder, tmp_path), skip=(1,), port=port,
                           timeout=120)
  assert rc == 2 and [_without_log(l) for l in _errors(err)] == [
      f"error: port {port} of --coordinator_address 127.0.0.1:{port} is in use by another "
      "program on this host, where process 0 hosts the run's coordinator; pick a free port "
      "and give it to every process"], err[-2000:]
  assert ".cc:" not in err and "Traceback" not in err


def _wait_for(path, text, timeout=120):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if path.exists() and text in path.read_text():
      return
    time.sleep(0.2)
  raise AssertionError(f"{text!r} never appeared in {path}")


def test_a_duplicate_process_id_is_refused_naming_it(tiny_folder, tmp_path):
  """The second process given --process_id 1 on this machine is refused at once; the
  others end when the run never fills (process 2 never starts), and the first process 1
  says that a duplicate of its id was refused."""
  port = coordinator_port()
  streams = {p: open(tmp_path / f"err{p}.txt", "w") for p in (0, 1)}
  # The first run waits 30 s for its missing process, so that it still holds --process_id 1
  # when the duplicate starts, however slowly a loaded machine imports jax.
  first = start(_load_args(tiny_folder, tmp_path)[:-1] + ["--process_timeout_s=30"], n=3,
                skip=(2,), port=port, stderr=streams)
  try:
    _wait_for(tmp_path / "err1.txt", "joining the 3-process run")
    (rc, _, err), = [(p.wait(timeout=120),) + p.communicate() for p in start(
        _load_args(tiny_folder, tmp_path), n=3, skip=(0, 2), port=port).values()]
    for p in first.values():
      p.wait(timeout=60)
  finally:
    for p in first.values():
      p.kill()
  assert rc == 2 and _errors(err) == [
      f"error: another process on this machine already runs as --process_id 1 of the run at "
      f"127.0.0.1:{port}; give each process its own --process_id in 0..2"], err[-2000:]
  joined = (f"error: not every process joined the 3-process run at 127.0.0.1:{port} within "
            "30 s; start each one with the same --coordinator_address and --num_processes, "
            "and its own --process_id")
  for p, said in ((0, joined), (1, joined + "; meanwhile another process on this machine was "
                  "started with this process's --process_id 1 and refused: give each process "
                  "its own --process_id in 0..2")):
    text = (tmp_path / f"err{p}.txt").read_text()
    assert [_without_log(l) for l in _errors(text)] == [said], text[-2000:]


def test_processes_given_different_counts_are_refused_naming_the_count(tiny_folder, tmp_path):
  port = coordinator_port()
  zero = start(_load_args(tiny_folder, tmp_path), n=2, skip=(1,), port=port)
  one = start(_load_args(tiny_folder, tmp_path), n=3, skip=(0, 2), port=port)
  (rc0, _, err0), (rc1, _, err1) = [(p.wait(timeout=120),) + p.communicate()
                                    for p in (zero[0], one[1])]
  why = ("process 1 was started with --num_processes=3, but process 0 runs 2 processes; "
         "start every process with the same --num_processes")
  assert rc1 == 2 and [_without_log(l) for l in _errors(err1)] == [f"error: {why}"], err1
  assert rc0 == 2 and [_without_log(l) for l in _errors(err0)] == [
      f"error: process 1 failed: {why}"], err0
  assert not any(name.endswith(".npz") for name in os.listdir(tmp_path))


def _holding(tiny_folder, tmp_path, phase="calibration"):
  return ["--mode=calibrate", f"--model_path={tiny_folder(MODEL)[0]}",
          f"--out_dir={tmp_path}", f"--hold_at={phase}", "--process_timeout_s=20"]


# Runs bash with SIGINT at its default, as a shell's foreground job has it (a test session
# started in the background ignores SIGINT, and bash cannot trap what it inherits ignored).
FOREGROUND = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
              "os.execvp('bash', ['bash', *sys.argv[1:]])")


def _launcher(tiny_folder, tmp_path, phase="calibration"):
  """benchmarks/local_processes.sh with 2 processes, each holding inside `phase`."""
  proc = subprocess.Popen(
      [sys.executable, "-c", FOREGROUND, "benchmarks/local_processes.sh", "2", "-m",
       "tests.multiprocess", *_holding(tiny_folder, tmp_path, phase)], cwd=ROOT, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHON": sys.executable})
  # Never wait forever: a run that does not reach `phase` is ended, and its EOF fails here.
  stuck = threading.Timer(240, lambda: os.killpg(proc.pid, signal.SIGKILL))
  stuck.start()
  holding = 0
  while holding < 2:
    line = proc.stdout.readline()
    assert line, proc.stderr.read()[-3000:]
    holding += line.count(f"holding at {phase}")  # a runtime line may precede it unended
  stuck.cancel()
  return proc


def _no_worker_left(tmp_path):
  found = subprocess.run(["pgrep", "-f", "--", f"--out_dir={tmp_path}"], capture_output=True,
                         text=True).stdout.split()
  assert not found, found


@pytest.mark.parametrize("how, status", [("SIGTERM", 143), ("Ctrl-C", 130)])
def test_the_launcher_passes_signals_on_and_every_process_ends(tiny_folder, tmp_path, how,
                                                               status):
  """SIGTERM to the launcher (timeout, a scheduler), or SIGINT to its whole process group
  (Ctrl-C on a terminal): every process ends with its interrupted line, the launcher with
  the signal's status, and nothing is written."""
  proc = _launcher(tiny_folder, tmp_path)
  if how == "SIGTERM":
    proc.send_signal(signal.SIGTERM)
  else:
    os.killpg(proc.pid, signal.SIGINT)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == status, err[-3000:]
  lines = _errors(err)
  assert len(lines) == 2 and all(l.startswith("interrupted: ") for l in lines), err[-3000:]
  assert "Traceback" not in err
  _no_worker_left(tmp_path)
  assert not any(name.endswith(".npz") for name in os.listdir(tmp_path))


@pytest.mark.parametrize("phase", ["decode", "compute"])
def test_sigterm_to_the_launcher_alone_ends_the_run(tiny_folder, tmp_path, phase):
  """`kill PID` of the launcher alone (as timeout or a scheduler sends it): the launcher,
  both supervisors and both workers end, each process with one interrupted line.  Between
  decode steps a worker ends itself and says so; inside one long XLA computation its
  handler waits, and its supervisor kills it (GRACE_S after the signal) and says so."""
  proc = _launcher(tiny_folder, tmp_path, phase)
  time.sleep(1)
  os.kill(proc.pid, signal.SIGTERM)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 143, err[-3000:]
  lines = _errors(err)
  assert len(lines) == 2 and all(l.startswith("interrupted: ") for l in lines), err[-3000:]
  killed = [" ended before it finished, and wrote no outputs" in l for l in lines]
  assert killed == [phase == "compute"] * 2, lines
  assert "Traceback" not in err
  _no_worker_left(tmp_path)


BACKGROUND = """
import subprocess, sys
# A background job of a non-interactive shell starts with SIGINT ignored.
subprocess.run(["bash", "-c", '"$0" "$@" & echo $!; wait $!; echo "status $?"'] + sys.argv[1:])
"""


def test_a_supervised_worker_started_in_the_background_takes_sigint(tiny_folder, tmp_path):
  """SIGINT to the supervisor of a process started with `&` reaches its worker, which
  restored the SIGINT its shell made it ignore, and the run ends as interrupted (130)."""
  port = coordinator_port()
  proc = subprocess.Popen(
      [sys.executable, "-c", BACKGROUND, sys.executable, "-m", "tests.multiprocess",
       *_holding(tiny_folder, tmp_path), f"--coordinator_address=127.0.0.1:{port}",
       "--num_processes=1", "--process_id=0"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  supervisor = int(proc.stdout.readline())
  while not proc.stdout.readline().startswith("holding at calibration"):
    pass
  os.kill(supervisor, signal.SIGINT)
  out, err = proc.communicate(timeout=60)
  assert out.splitlines()[-1] == "status 130", out + err[-3000:]
  lines = _errors(err)
  assert len(lines) == 1 and lines[0].startswith("interrupted: "), err[-3000:]
  assert "Traceback" not in err
  _no_worker_left(tmp_path)
