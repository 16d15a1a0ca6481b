"""Print a free TCP port for a local run's coordinator, chosen below the ephemeral range.

A port from `bind(("127.0.0.1", 0))` comes from the kernel's ephemeral range, the range
every outgoing connection draws its source port from.  Between picking such a port and
process 0 binding it, another run's gloo or gRPC connection on this host can take it
(CI saw it: "port 36169 ... is in use by another program").  The kernel never hands out
a port below that range on its own, so a free one there stays free until a program asks
for it by number.  Standard library only: `local_processes.sh` runs it before any jax.
"""

from __future__ import annotations

import random
import socket

_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
_SPAN = 16384  # how many ports below the ephemeral range to draw from


def ephemeral_range() -> tuple[int, int]:
  """The kernel's ephemeral ports, inclusive (Linux's default where it cannot be read)."""
  try:
    with open(_EPHEMERAL) as f:
      low, high = map(int, f.read().split())
    return low, high
  except (OSError, ValueError):
    return 32768, 60999


def is_free(port: int) -> bool:
  """Whether nothing on this host holds `port` (the probe process 0's check makes)."""
  with socket.socket() as probe:
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      probe.bind(("0.0.0.0", port))
    except OSError:
      return False
  return True


def coordinator_port(rng: random.Random | None = None) -> int:
  """A free port below the ephemeral range (above it where too few lie below)."""
  rng = rng or random.SystemRandom()
  low, high = ephemeral_range()
  below = range(max(1024, low - _SPAN), low)
  ports = below if len(below) >= 1024 else range(high + 1, 65536)
  for _ in range(200):
    port = rng.choice(ports)
    if is_free(port):
      return port
  raise OSError(f"no free port found in {ports.start}..{ports.stop - 1}")


if __name__ == "__main__":
  print(coordinator_port())
