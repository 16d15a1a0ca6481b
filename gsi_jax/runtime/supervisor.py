"""One process of a multi-process run watches itself from outside: it runs as a child.

jaxlib ends a process whose coordination service (hosted by process 0) disappears with a
C++ `LOG(FATAL)`: a "Check failure stack trace", "Fatal Python error: Aborted" and a
thread dump, within a second and from a thread that Python cannot intercept.  So each
process of a run re-executes its own command line as a child and reads the child's
stderr.  Whatever the child prints goes to a log file; the terminal gets the same lines
except the runtime's C++ log lines that lead into a crash, and the crash dump itself.
However the child ends, the terminal shows at most one `error:` line, which names the log;
the runtime failures whose cause is the run's settings (a duplicate --process_id, another
--num_processes than process 0's, a coordinator port in use) are named as such.

The supervisor holds no runtime state: it never initialises a JAX backend, so it cannot
be aborted by one.  When it is killed, the kernel kills its child (PR_SET_PDEATHSIG).
SIGINT and SIGTERM sent to it are forwarded to the child, which restores both (a
background job of a non-interactive shell starts with SIGINT ignored) and ends with one
`interrupted:` line; a child that has not ended GRACE_S later is killed.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import signal
import socket
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
GRACE_S = 5  # how long an interrupted child may take to end before it is killed
# What the runtime's last words in a child's log mean, first match wins: (pattern, message
# given the process, e.g. "process 1 of 2", its id and the run's coordinator address).
_RUNTIME_ENDS = (
    (re.compile(r"request from a newer incarnation"),
     "{who} was replaced in the run by another process started with the same --process_id "
     "{id}; give each process its own --process_id"),
    (re.compile(r"Unexpected task registered with task=(\d+)"),
     "{who} is not a process of the run at {address}: process 0 was started with a smaller "
     "--num_processes; start every process with the same --num_processes"),
    (re.compile(r"Failed to add port to server"),
     "{who} could not host the run's coordinator at {address}: another program holds its "
     "port; pick a free port and give it to every process"),
    (re.compile(r"JAX distributed service detected fatal errors|"
                r"Failed to send RPC to coordination service|leader task"),
     "{who} lost the run's coordinator, process 0: it stopped or cannot be reached; every "
     "process of the run ends"),
)


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


def _locked(path: str):
  """`path` opened and flocked by this process alone, or None when another holds it."""
  f = open(path, "a", encoding="utf-8")
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    f.close()
    return None
  return f


def _claim_path(address: str, process: str, suffix: str) -> str:
  """The claim's file, one per run whatever the coordinator's spelling: localhost:1234 and
  127.0.0.1:1234 name one run, so a duplicate is refused before it opens any log."""
  host, _, port = address.rpartition(":")
  try:
    address = f"{socket.gethostbyname(host.strip('[]'))}:{port}" if host else address
  except OSError:  # unresolvable here: the spelling is all there is
    pass
  name = re.sub(r"[^A-Za-z0-9._-]+", "_", address)
  return os.path.join(tempfile.gettempdir(), f"gsi_jax-run-{name}-process{process}.{suffix}")


def claim_process_id(address: str, process: str):
  """Hold this machine's claim on `process` of the run at `address` (an flock in the
  temporary folder, released when this process ends); None when another process on this
  machine holds it already, which is then told through a `.refused` file beside the lock
  (whose end, a run that never fills, is then named by its cause)."""
  claim = _locked(_claim_path(address, process, "lock"))
  refused = _claim_path(address, process, "refused")
  if claim is None:
    try:
      with open(refused, "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))
    except OSError:  # the claim's holder is not told; this process is refused all the same
      pass
  else:  # a duplicate of an earlier run's may have left one
    _remove(refused)
  return claim


def _remove(path: str) -> bool:
  """Whether path was there to remove (another process may remove it first)."""
  try:
    os.unlink(path)
  except FileNotFoundError:
    return False
  return True


def _duplicate_was_refused(address: str, process: str) -> bool:
  """Whether a process started with this one's --process_id was refused while it ran."""
  return _remove(_claim_path(address, process, "refused"))


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
  into a fatal error never reach the terminal.  The child's first `error:` line is held
  back too, to be printed once the child has ended, with the log's path; a later one goes
  to the log alone.  Once the run is interrupted (`quiet`), only the child's
  `interrupted:` line reaches the terminal.
  """

  def __init__(self, source, log, terminal):
    self.source, self.log, self.terminal = source, log, terminal
    self.held: list[str] = []
    self.error_line: str | None = None
    self.interrupted_line: str | None = None
    self.fatal = False
    self.quiet = threading.Event()

  def run(self) -> None:
    for raw in iter(self.source.readline, b""):
      line = raw.decode("utf-8", "replace")
      self.log.write(line)
      self.log.flush()
      if line.startswith("interrupted: "):
        self.interrupted_line = line.rstrip("\n")
        continue
      if self.fatal or self.quiet.is_set():
        continue
      if _FATAL.match(line):
        self.fatal = True
      elif line.startswith("error: "):
        if self.error_line is None:
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


def _open_log(log: str):
  """The log, flocked for this process; a path another process writes gets this process's
  pid in its name, so two processes never share a log."""
  f = _locked(log)
  if f is None:
    log = f"{os.path.splitext(log)[0]}.{os.getpid()}.log"
    f = _locked(log)
  f.truncate(0)
  return log, f


def _runtime_end(log: str, status: int, **names) -> str:
  """Why the runtime ended the child, from the last words in its log."""
  with open(log, encoding="utf-8", errors="replace") as f:
    text = f.read()
  for pattern, message in _RUNTIME_ENDS:
    if pattern.search(text):
      return message.format(**names)
  return f"{names['who']} was ended by {signal.Signals(-status).name}"


def supervise(process: str, num_processes: int | None, log: str, address: str = "") -> int:
  """Run this command line again as a child; return the exit status to leave with."""
  who = f"process {process} of {num_processes}" if num_processes else f"process {process}"
  claim = claim_process_id(address, process) if address and process != "auto" else True
  if claim is None:
    print(f"error: another process on this machine already runs as --process_id {process} of "
          f"the run at {address}; give each process its own --process_id in "
          f"0..{num_processes - 1}", file=sys.stderr)
    return 2
  try:
    log, log_file = _open_log(log)
  except OSError as e:
    print(f"error: cannot write the process log {log} ({e.strerror}); free room or "
          "permissions there", file=sys.stderr)
    return 2
  env = {**os.environ, CHILD_ENV: str(os.getpid())}
  command = [sys.executable, *sys.orig_argv[1:]]
  child, relay, signalled = None, None, []

  def forward(signum, frame):
    """The first signal goes on to the child (a launcher and a terminal may both send one);
    a child still running GRACE_S later is killed."""
    del frame
    signalled.append(signum)
    if len(signalled) > 1 and child is not None:
      return
    if relay is not None:
      relay.quiet.set()
    if child is not None and child.poll() is None:
      child.send_signal(signum)
      killer = threading.Timer(GRACE_S, lambda: child.poll() is None and child.kill())
      killer.daemon = True
      killer.start()

  # Before the child starts, so that a signal in between is not lost.
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, forward)
  # Its own process group: a Ctrl-C reaches the child once, through the supervisor.
  child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, process_group=0)
  relay = _Relay(child.stderr, log_file, sys.stderr)
  if signalled:  # sent before the child existed
    first = signalled[0]
    signalled.clear()
    forward(first, None)
  reader = threading.Thread(target=relay.run, daemon=True)
  reader.start()
  status = child.wait()
  reader.join()
  log_file.close()
  if status == 0:
    relay.release()
    os.unlink(log)
    return 0
  if relay.interrupted_line is not None or signalled:  # the run was interrupted: one line
    print(relay.interrupted_line or f"interrupted: {who} ended before it finished, and wrote "
          f"no outputs (its log: {log})", file=sys.stderr, flush=True)
    return status if status in (130, 143) else 143 if signal.SIGTERM in signalled else 130
  if relay.error_line is not None:
    message = relay.error_line
    if claim is not True and _duplicate_was_refused(address, process):
      message += (f"; meanwhile another process on this machine was started with this "
                  f"process's --process_id {process} and refused: give each process its own "
                  f"--process_id in 0..{num_processes - 1}")
  elif status > 0:  # a Python traceback or an exit status of the script's own: shown as is
    relay.release()
    print(f"{who} ended with status {status}; its log: {log}", file=sys.stderr)
    return status
  else:
    message = _runtime_end(log, status, who=who, id=process, address=address)
  relay.held = []  # the runtime's lines that led here are in the log
  print(f"error: {message} (its log: {log})", file=sys.stderr, flush=True)
  return 2
