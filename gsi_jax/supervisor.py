"""One process of a multi-process run watches itself from outside: it runs as a child.

jaxlib ends a process whose coordination service (hosted by process 0) disappears with a
C++ `LOG(FATAL)`: a "Check failure stack trace", "Fatal Python error: Aborted" and a
thread dump, within a second and from a thread that Python cannot intercept.  So each
process of a run re-executes its own command line as a child and reads the child's
stderr.  Whatever the child prints goes to a log file; the terminal gets the same lines
except the runtime's C++ log lines that lead into a crash, and the crash dump itself.
However the child ends, the terminal shows at most one `error:` line, which names the log.

The supervisor holds no runtime state: it never initialises a JAX backend, so it cannot
be aborted by one.  When it is killed, the kernel kills its child (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading

CHILD_ENV = "GSI_JAX_SUPERVISED_BY"  # the supervisor's pid, in the child's environment
_PR_SET_PDEATHSIG = 1
# A C++ runtime log line (glog format, a .cc/.h source); Python's absl lines name a .py.
_RUNTIME_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+\.(cc|h|cpp):\d+\]")
_PYTHON_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+\.py:\d+\]")
_FATAL = re.compile(r"^(F\d{4} \d\d:\d\d|\*\*\* Check failure stack trace|Fatal Python error)")
_COORDINATOR_LOST = re.compile(r"JAX distributed service detected fatal errors|"
                               r"Failed to send RPC to coordination service|leader task")


def is_child() -> bool:
  return os.environ.get(CHILD_ENV) is not None


def bind_to_supervisor() -> None:
  """In the child: die with the supervisor, so that a killed process leaves nothing behind."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):  # not Linux: the supervisor's signal handlers remain
    return
  if str(os.getppid()) != os.environ.get(CHILD_ENV):  # the supervisor died before prctl
    os._exit(2)


def log_path(out: str | None, script: str, process: str) -> str:
  """Beside --out when its folder exists, else in the system's temporary folder."""
  folder = os.path.dirname(os.path.abspath(out)) if out else ""
  if not (folder and os.path.isdir(folder) and os.access(folder, os.W_OK)):
    folder, stem = tempfile.gettempdir(), f"gsi_jax-{script}-{os.getpid()}"
  else:
    stem = os.path.splitext(os.path.basename(out))[0]
  return os.path.join(folder, f"{stem}.process{process}.log")


class _Relay:
  """Copies the child's stderr to the log, and to the terminal all but a crash's lines.

  Runtime (C++) lines are held back until a Python line follows them: those that lead
  into a fatal error never reach the terminal.  The child's own `error:` line is held
  back too, to be printed once the child has ended, with the log's path.
  """

  def __init__(self, source, log, terminal):
    self.source, self.log, self.terminal = source, log, terminal
    self.held: list[str] = []
    self.error_line: str | None = None
    self.fatal = False

  def run(self) -> None:
    for raw in iter(self.source.readline, b""):
      line = raw.decode("utf-8", "replace")
      self.log.write(line)
      self.log.flush()
      if self.fatal:
        continue
      if _FATAL.match(line):
        self.fatal = True
      elif line.startswith("error: ") and self.error_line is None:
        self.error_line = line.rstrip("\n")[len("error: "):]
      elif _RUNTIME_LINE.match(line) or (self.held and not _PYTHON_LOG_LINE.match(line)):
        self.held.append(line)
      else:
        self.release()
        self.terminal.write(line)
        self.terminal.flush()

  def release(self) -> None:
    self.terminal.writelines(self.held)
    self.held = []


def supervise(process: str, num_processes: int | None, log: str) -> int:
  """Run this command line again as a child; return the exit status to leave with."""
  env = {**os.environ, CHILD_ENV: str(os.getpid())}
  command = [sys.executable, *sys.orig_argv[1:]]
  try:
    log_file = open(log, "w", encoding="utf-8")
  except OSError as e:
    print(f"error: cannot write the process log {log} ({e.strerror}); free room or "
          "permissions there", file=sys.stderr)
    return 2
  # Its own process group: a Ctrl-C reaches the child once, through the supervisor.
  child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, process_group=0)
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda s, _: child.send_signal(s))
  relay = _Relay(child.stderr, log_file, sys.stderr)
  reader = threading.Thread(target=relay.run, daemon=True)
  reader.start()
  status = child.wait()
  reader.join()
  log_file.close()
  if status == 0:
    relay.release()
    os.unlink(log)
    return 0
  who = f"process {process} of {num_processes}" if num_processes else f"process {process}"
  if relay.error_line is not None:
    message = relay.error_line
  elif status > 0:  # a Python traceback or an exit status of the script's own: shown as is
    relay.release()
    print(f"{who} ended with status {status}; its log: {log}", file=sys.stderr)
    return status
  else:
    with open(log, encoding="utf-8", errors="replace") as f:
      lost = _COORDINATOR_LOST.search(f.read())
    message = (f"{who} lost the run's coordinator, process 0: it stopped or cannot be "
               "reached; every process of the run ends" if lost else
               f"{who} was ended by {signal.Signals(-status).name}")
  if relay.fatal or status < 0:
    relay.held = []  # what led into the crash is in the log
  relay.release()
  print(f"error: {message} (its log: {log})", file=sys.stderr, flush=True)
  return 2
