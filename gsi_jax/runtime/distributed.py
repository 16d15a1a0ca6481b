"""More than one process: JAX's multi-controller runtime, joined from flags or the cluster.

Every process runs the same program over its own devices; `sharding.make_mesh()` then
spans the devices of all of them, and XLA's collectives (gloo on CPU, NCCL/RCCL on
GPUs) cross processes.  Without a coordinator, and without `auto`, a run is one
process exactly as before.  Three things are added to what `jax.distributed` does:

- `agree` refuses, before any compute, processes started with different settings
  (another k, model or eps would make their collectives wait on each other forever), and
  `check_count` a process whose --num_processes is not the run's; process 0 refuses a
  coordinator port that another program holds before the runtime tries it.
- A watchdog ends every process within `timeout_s` with one `error:` line when a
  peer never joins, stops answering, or fails.  JAX's own fate-sharing would end them
  too, a little later, but through a C++ abort and its stack trace (which is all that
  remains when process 0 dies: `gsi_jax.runtime.supervisor` turns that into one line).
- `host_copy` and `is_primary`: whole host values of sharded arrays, and one writer.

However a process ends, it says one line: `say` prints the first `error:` or
`interrupted:` line of this process and drops any later one (the watchdog's thread and
a failed collective can both find the same failure).
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import hashlib
import json
import logging
import os
import random
import re
import socket
import sys
import threading
import time

import jax
import numpy as np

from gsi_jax.errors import GSIError

PULSE_S = 1.0  # how often each process says it is alive
_KEY = "gsi_jax/"
_joined = threading.Event()  # set once this process has joined the others
_leaving = threading.Event()  # set once this process is on its way out: one error line only
_said = threading.Lock()  # held once this process has said its one closing line
_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:(\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
  """How this process joins the others; checked on construction."""
  coordinator_address: str = ""  # host:port of process 0; "" = one process (or auto)
  num_processes: int | None = None
  process_id: int | None = None
  auto: bool = False  # let jax.distributed detect the cluster (SLURM, Open MPI, ...)
  timeout_s: int = 60  # a peer that has not joined, or stops answering, by then ends the run

  def __post_init__(self):
    if self.timeout_s < 5:
      raise GSIError(f"--process_timeout_s must be >= 5 seconds, got {self.timeout_s}")
    if not self.coordinator_address:
      if not self.auto and (self.num_processes not in (None, 1) or self.process_id not in (None, 0)):
        raise GSIError("--num_processes and --process_id need --coordinator_address "
                       "(host:port of process 0), or --distributed_auto on a cluster")
      return
    port = _ADDRESS.match(self.coordinator_address)
    if not port or not 0 < int(port.group(1)) < 65536:
      raise GSIError(f"--coordinator_address must be host:port, got {self.coordinator_address!r}")
    if self.num_processes is None or self.num_processes < 1:
      raise GSIError(f"--coordinator_address needs --num_processes >= 1, got {self.num_processes}")
    if self.process_id is None or not 0 <= self.process_id < self.num_processes:
      raise GSIError(f"--process_id must be in 0..{self.num_processes - 1}, got {self.process_id}")

  @property
  def joins(self) -> bool:
    return bool(self.coordinator_address) or self.auto


def port_held(port: int) -> bool:
  """Whether another program holds `port` on this host, probed on every interface (`[::]`,
  as gRPC binds it; 0.0.0.0 where the host has no IPv6)."""
  for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
    try:
      probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 on this host: the IPv4 probe decides
      continue
    with probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        probe.bind((host, port))
      except OSError as e:
        if e.errno != errno.EADDRINUSE:
          continue
        return True
      return False
  return False


def check_port_free(address: str) -> None:
  """Process 0 hosts the runtime's coordination service on every interface at the port of
  `address`; a port that another program holds would end it in a C++ error or a crash."""
  port = int(_ADDRESS.match(address).group(1))
  if port_held(port):
    raise GSIError(f"port {port} of --coordinator_address {address} is in use by another "
                   "program on this host, where process 0 hosts the run's coordinator; "
                   "pick a free port and give it to every process")


def ephemeral_range() -> tuple[int, int]:
  """The kernel's ephemeral ports, inclusive (Linux's default where it cannot be read)."""
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
      low, high = map(int, f.read().split())
    return low, high
  except (OSError, ValueError):
    return 32768, 60999


def coordinator_port(rng: random.Random | None = None) -> int:
  """A free port for a run of local processes, below the ephemeral range (above it where
  fewer than 1024 ports lie below).  Every outgoing connection takes its source port from
  that range, so a port picked there (`bind(0)`) can be taken before process 0 binds it
  (it was, in CI); one below it is never handed out unless a program asks for it."""
  rng = rng or random.SystemRandom()
  low, high = ephemeral_range()
  below = range(max(1024, low - 16384), low)
  ports = below if len(below) >= 1024 else range(high + 1, 65536)
  for _ in range(200):
    port = rng.choice(ports)
    if not port_held(port):
      return port
  raise GSIError(f"no free port found in {ports.start}..{ports.stop - 1}; give "
                 "--coordinator_address a port of your own")


def initialize(config: ProcessConfig) -> None:
  """Join the other processes (a no-op for one process), then watch them."""
  if not config.joins or jax.distributed.is_initialized():
    return
  if config.coordinator_address and config.process_id == 0:
    check_port_free(config.coordinator_address)
  # Collectives between CPU devices go through gloo (GPUs use NCCL/RCCL regardless).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  run = (f"the {config.num_processes}-process run at {config.coordinator_address}"
         if config.coordinator_address else "the cluster's run")
  logging.info("joining %s as process %s", run, config.process_id)
  # JAX's own limits sit behind ours, so that our watchdog speaks first.
  joining = _deadline(config.timeout_s, f"not every process joined {run} within "
                      f"{config.timeout_s} s; start each one with the same "
                      "--coordinator_address and --num_processes, and its own --process_id")
  try:
    jax.distributed.initialize(
        config.coordinator_address or None, config.num_processes, config.process_id,
        initialization_timeout=config.timeout_s + 30,
        heartbeat_timeout_seconds=config.timeout_s + 30)
  except Exception as e:  # noqa: BLE001  jaxlib raises several types here
    raise GSIError(f"cannot join {run} ({type(e).__name__}: {str(e)[:200]})") from None
  finally:
    joining.cancel()
  _joined.set()
  _Watchdog(config.timeout_s).start()
  me, n = jax.process_index(), jax.process_count()
  role = "computes and writes" if me == 0 else "computes, process 0 writes"
  logging.info("process %d of %d: %s; %d devices in all", me, n, role, jax.device_count())


def joined() -> bool:
  """Whether this process has joined others (then it must leave through `leave`)."""
  return _joined.is_set()


def is_primary() -> bool:
  """The one process that writes files (outputs, checkpoints) for all of them."""
  return jax.process_index() == 0


def agree(settings: dict) -> None:
  """Refuse processes started with different settings, naming the settings that differ."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils
  names = sorted(settings)
  digests = np.stack([np.frombuffer(hashlib.sha256(json.dumps(
      settings[n], sort_keys=True, default=str).encode()).digest(), np.uint8) for n in names])
  everyone = np.asarray(multihost_utils.process_allgather(digests))  # (processes, names, 32)
  differ = [n for i, n in enumerate(names) if not (everyone[:, i] == everyone[0, i]).all()]
  if differ:
    who = [p for p in range(len(everyone)) if not (everyone[p] == everyone[0]).all()]
    raise GSIError(f"processes {who} were started with another {', '.join(differ)} than "
                   "process 0; start every process with the same flags")


def check_count(num_processes: int | None) -> None:
  """Refuse a process started with another --num_processes than process 0 (the runtime
  takes process 0's count and would run on without it)."""
  if num_processes is not None and num_processes != jax.process_count():
    raise GSIError(f"process {jax.process_index()} was started with --num_processes="
                   f"{num_processes}, but process 0 runs {jax.process_count()} processes; start "
                   "every process with the same --num_processes")


def host_copy(x) -> np.ndarray:
  """The whole value of an array on this host, also when other processes hold parts of it."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def from_primary(value: int) -> int:
  """Process 0's integer, on every process once process 0 has it (so also a barrier)."""
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils
  return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


def same_as_primary(value: int, what: str, where: str) -> None:
  """Refuse a run whose processes see different files at `where` (no shared file system)."""
  if from_primary(value) != value:
    raise GSIError(f"process {jax.process_index()} finds {what} at {where} other than process "
                   "0 does; in a run of several processes it must be on a file system that "
                   "every process shares")


def say(line: str) -> bool:
  """Print this process's one closing line (`error: ...` or `interrupted: ...`); False, and
  nothing printed, when it has said one already."""
  if not _said.acquire(blocking=False):
    return False
  _leaving.set()
  print(line, file=sys.stderr, flush=True)
  return True


def has_said() -> bool:
  return _said.locked()


def _fail(message: str, status: int = 2) -> None:
  if _leaving.is_set():  # already leaving, with its own line
    return
  if say(message if message.startswith("interrupted: ") else f"error: {message}"):
    leave(status)


def leave(status: int) -> None:
  """Exit now.  Once the processes have joined, a normal exit would wait in JAX's shutdown
  barrier for peers that are gone, then abort with a C++ stack trace.  Process 0 hosts the
  runtime's coordination service: it waits (a few pulses at most) for the others to leave
  first, since a peer still talking to a service that is gone aborts inside jaxlib."""
  _leaving.set()
  sys.stdout.flush()
  sys.stderr.flush()
  if not joined():
    if threading.current_thread() is threading.main_thread():
      sys.exit(status)
    os._exit(status)  # the join's timer: sys.exit would end only its thread
  try:
    client = _client()
    client.key_value_set(f"{_KEY}left/{jax.process_index()}", str(status), allow_overwrite=True)
    deadline = time.monotonic() + 5 * PULSE_S
    while is_primary() and time.monotonic() < deadline and len(
        client.key_value_dir_get(f"{_KEY}left/")) < jax.process_count():
      time.sleep(PULSE_S / 10)
  except Exception:  # noqa: BLE001  the coordinator may be gone already
    pass
  os._exit(status)


def _deadline(seconds: float, message: str) -> threading.Timer:
  timer = threading.Timer(seconds, _fail, args=(message,))
  timer.daemon = True
  timer.start()
  return timer


def _client():
  from jax._src import distributed  # the runtime's key-value store; Orbax reads it too
  return distributed.global_state.client


class _Watchdog(threading.Thread):
  """Each process bumps its own key every PULSE_S; a peer whose key stands still for
  timeout_s, or that says it failed, ends this process with one error line.  A process
  that finished says so at exit, so that its silence is not taken for a death."""

  def __init__(self, timeout_s: float):
    super().__init__(name="gsi_jax-watchdog", daemon=True)
    self.timeout_s, self.me, self.n = timeout_s, jax.process_index(), jax.process_count()
    self.stopped = threading.Event()
    atexit.register(self.finish)

  def finish(self) -> None:
    self.stopped.set()
    try:
      _client().key_value_set(f"{_KEY}done/{self.me}", "1", allow_overwrite=True)
    except Exception:  # noqa: BLE001  the coordinator may be gone already
      pass

  def run(self) -> None:
    beat, seen = 0, {p: (None, time.monotonic()) for p in range(self.n) if p != self.me}
    while not self.stopped.wait(PULSE_S):
      if _leaving.is_set():
        return
      try:
        client = _client()
        beat += 1
        client.key_value_set(f"{_KEY}alive/{self.me}", str(beat), allow_overwrite=True)
        alive = dict(client.key_value_dir_get(f"{_KEY}alive/"))
        done = {k.rsplit("/", 1)[-1] for k, _ in client.key_value_dir_get(f"{_KEY}done/")}
        failed = dict(client.key_value_dir_get(f"{_KEY}failed/"))
        interrupted = dict(client.key_value_dir_get(f"{_KEY}interrupted/"))
      except Exception as e:  # noqa: BLE001
        if self.stopped.is_set():
          return
        _fail(f"lost the coordinator (process 0) of this {self.n}-process run "
              f"({type(e).__name__}); it stopped or cannot be reached")
      for key, status in interrupted.items():
        if key.rsplit("/", 1)[-1] != str(self.me):
          _fail(interrupted_line(int(key.rsplit("/", 1)[-1]), self.n), int(status))
      for key, message in failed.items():
        if key.rsplit("/", 1)[-1] != str(self.me):
          _fail(f"process {key.rsplit('/', 1)[-1]} failed: {message}")
      now = time.monotonic()
      for p, (last, since) in list(seen.items()):
        value = alive.get(f"{_KEY}alive/{p}")
        if str(p) in done:
          seen.pop(p)
        elif value != last:
          seen[p] = (value, now)
        elif now - since > self.timeout_s:
          _fail(f"process {p} of {self.n} stopped answering (nothing from it for "
                f"{self.timeout_s} s); every process of the run ends")


_LOST_PEER = re.compile(r"(Gloo|NCCL|RCCL|MPI)\b.*(closed by peer|Connection reset|"
                        r"unhandled system error|remote process exited)", re.I | re.S)


def lost_peer(error: BaseException) -> str | None:
  """One line for a collective that failed because another process went away, else None."""
  found = _LOST_PEER.search(str(error))
  if not found or jax.process_count() == 1:
    return None
  return (f"another process of this {jax.process_count()}-process run went away during a "
          f"collective ({found.group(1)}: {found.group(2)}); every process of the run ends")


def interrupted_line(process: int, n: int) -> str:
  return (f"interrupted: process {process} of this {n}-process run was interrupted (Ctrl-C or "
          "SIGTERM); every process of the run ends, and none writes its outputs")


def report_interrupt(status: int) -> None:
  """Tell the other processes that this one was interrupted (exit status 130 or 143), so
  that each ends as interrupted too, not as failed."""
  _leaving.set()
  if joined():
    try:
      _client().key_value_set(f"{_KEY}interrupted/{jax.process_index()}", str(status),
                              allow_overwrite=True)
    except Exception:  # noqa: BLE001
      pass


def interrupted_peer() -> tuple[str, int] | None:
  """(the line to say, the exit status to leave with) when a peer was interrupted."""
  if not joined():
    return None
  try:
    found = _client().key_value_dir_get(f"{_KEY}interrupted/")
  except Exception:  # noqa: BLE001  the coordinator may be gone already
    return None
  peers = sorted((int(k.rsplit("/", 1)[-1]), int(v)) for k, v in found)
  peer = next((p for p in peers if p[0] != jax.process_index()), None)
  return None if peer is None else (interrupted_line(peer[0], jax.process_count()), peer[1])


def report_failure(message: str) -> None:
  """Tell the other processes that this one failed, so that they end now, not on timeout."""
  _leaving.set()  # this process says its own error; its watchdog says no other
  if jax.process_count() > 1:
    try:
      _client().key_value_set(f"{_KEY}failed/{jax.process_index()}", message[:500],
                              allow_overwrite=True)
    except Exception:  # noqa: BLE001
      pass
