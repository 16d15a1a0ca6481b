"""What a supervised process shows on the terminal and keeps in its log (no processes here:
tests/test_distributed.py kills real ones)."""

import io
import os
import tempfile

from gsi_jax import supervisor

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
    '  File "/work/main/gsi_jax/distributed.py", line 170 in leave\n',
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
