"""What a supervised process shows on the terminal and keeps in its log (no processes here:
tests/test_distributed.py kills real ones)."""

import io
import os
import subprocess
import sys
import tempfile

import pytest

from gsi_jax.runtime import supervisor
from tests.multiprocess import ABSL_INFO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PY_LINE = "I1204 04:58:18.848314 140477888183168 cache.py:80] calibrating tiny on 4096 tokens\n"
CC_WARNING = ("W1204 04:58:22.634604    2375 preemption_sync_manager.cc:147] Failed to retrieve "
              "preemption notice from coordination service: UNAVAILABLE: Socket closed\n")
CONTINUATION = "Additional GRPC error information from remote target coordination_service\n"
CRASH = [
    "E1204 04:58:22.634692    2375 coordination_service_agent.cc:289] Polled an error\n",
    "F1204 04:58:22.634701    2375 client.h:80] Terminating process because the JAX "
    "distributed service detected fatal errors.\n",
    "*** Check failure stack trace: ***\n",
    "    @     0x7f1adf840634  absl::log_internal::LogMessage::SendToLog()\n",
    "Fatal Python error: Aborted\n",
    '  File "/work/main/gsi_jax/runtime/distributed.py", line 170 in leave\n',
]


def relay(lines):
  log, terminal = io.StringIO(), io.StringIO()
  r = supervisor._Relay(io.BytesIO("".join(lines).encode()), log, terminal)
  r.run()
  return r, log.getvalue(), terminal.getvalue()


def test_runtime_lines_reach_the_terminal_once_a_python_line_follows():
  r, log, terminal = relay([PY_LINE, CC_WARNING, CONTINUATION, PY_LINE])
  assert terminal == log == PY_LINE + CC_WARNING + CONTINUATION + PY_LINE
  assert not r.fatal and r.error_line is None


def test_a_crash_and_the_runtime_lines_before_it_stay_in_the_log():
  r, log, terminal = relay([PY_LINE, CC_WARNING, CONTINUATION, *CRASH])
  assert terminal == PY_LINE
  assert log == PY_LINE + CC_WARNING + CONTINUATION + "".join(CRASH)
  assert r.fatal and r.held == [CC_WARNING, CONTINUATION, CRASH[0]]


def test_the_childs_error_line_is_held_for_the_supervisor_to_print():
  error = "error: another process of this 2-process run went away during a collective\n"
  r, log, terminal = relay([PY_LINE, error])
  assert terminal == PY_LINE and error in log
  assert r.error_line == error[len("error: "):].rstrip("\n")


def test_the_log_goes_beside_out_or_to_the_temporary_folder(tmp_path):
  out = tmp_path / "runs" / "table.json"
  assert supervisor.log_path(str(out), "quality_table", "1") == os.path.join(
      tempfile.gettempdir(), f"gsi_jax-quality_table-{os.getpid()}.process1.log")
  out.parent.mkdir()
  assert supervisor.log_path(str(out), "quality_table", "1") == str(
      tmp_path / "runs" / "table.process1.log")
  assert supervisor.log_path(None, "scale", "0").startswith(tempfile.gettempdir())


def test_only_the_first_error_line_is_held_and_later_ones_stay_in_the_log():
  first = "error: process 1 of 2 stopped answering\n"
  later = "error: another process of this 2-process run went away during a collective\n"
  r, log, terminal = relay([PY_LINE, first, later])
  assert terminal == PY_LINE and log == PY_LINE + first + later
  assert r.error_line == first[len("error: "):].rstrip("\n")


def test_once_interrupted_only_the_interrupted_line_is_kept_for_the_terminal():
  log, terminal = io.StringIO(), io.StringIO()
  lines = [PY_LINE, "Traceback (most recent call last):\n", "KeyboardInterrupt\n",
           "interrupted: nothing partial was written\n"]
  r = supervisor._Relay(io.BytesIO("".join(lines).encode()), log, terminal)
  r.quiet.set()
  r.run()
  assert terminal.getvalue() == "" and log.getvalue() == "".join(lines)
  assert r.interrupted_line == "interrupted: nothing partial was written"


@pytest.mark.parametrize("last_words, message", [
    ("absl::Status: ALREADY_EXISTS: Aborted connect attempt as there is a request from a "
     "newer incarnation.", "process 1 of 3 was replaced in the run by another process started "
     "with the same --process_id 1; give each process its own --process_id"),
    ("absl::Status: INVALID_ARGUMENT: Unexpected task registered with task=1",
     "process 1 of 3 is not a process of the run at h:9: process 0 was started with a smaller "
     "--num_processes; start every process with the same --num_processes"),
    ("E1206 add_port.cc:83] Failed to add port to server: No address added out of total 1 "
     "resolved for '[::]:9'", "process 1 of 3 could not host the run's coordinator at h:9: "
     "another program holds its port; pick a free port and give it to every process"),
    ("Terminating process because the JAX distributed service detected fatal errors.",
     "process 1 of 3 lost the run's coordinator, process 0: it stopped or cannot be reached; "
     "every process of the run ends"),
    ("Segmentation fault", "process 1 of 3 was ended by SIGSEGV"),
])
def test_the_runtime_s_last_words_name_the_run_setting_behind_them(tmp_path, last_words,
                                                                    message):
  log = tmp_path / "p.log"
  log.write_text(PY_LINE + last_words + "\n")
  assert supervisor._runtime_end(str(log), -11, who="process 1 of 3", id="1",
                                 address="h:9") == message


def test_a_process_id_is_claimed_once_and_a_log_is_never_shared(tmp_path):
  address = f"127.0.0.1:{os.getpid()}"
  claim = supervisor.claim_process_id(address, "1")
  assert claim is not None and supervisor.claim_process_id(address, "1") is None
  assert supervisor.claim_process_id(address, "0") is not None
  claim.close()
  assert supervisor.claim_process_id(address, "1") is not None
  path = str(tmp_path / "run.process1.log")
  first, f1 = supervisor._open_log(path)
  second, f2 = supervisor._open_log(path)
  assert first == path and second == str(tmp_path / f"run.process1.{os.getpid()}.log")
  f1.close(), f2.close()


def test_one_run_spelled_two_ways_is_claimed_once():
  """localhost and 127.0.0.1 name one coordinator: the duplicate is refused at its claim,
  before it could open a log."""
  port = os.getpid() + 1
  claim = supervisor.claim_process_id(f"127.0.0.1:{port}", "2")
  assert claim is not None
  assert supervisor.claim_process_id(f"localhost:{port}", "2") is None
  claim.close()


SAID_TWICE = """
from gsi_jax import cli
from gsi_jax.runtime import distributed
from gsi_jax.errors import GSIError
def main(argv):
  distributed.say("error: the watchdog's line")  # its thread spoke first
  raise GSIError("the failed collective's line")
cli.run(main)
"""


def test_a_process_says_one_closing_line_whoever_speaks_second():
  proc = subprocess.run([sys.executable, "-c", SAID_TWICE], capture_output=True, text=True,
                        cwd=ROOT, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 2
  assert [l for l in proc.stderr.strip().splitlines() if not ABSL_INFO.match(l)] == [
      "error: the watchdog's line"]
