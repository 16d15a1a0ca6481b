"""The coordinator port of a local run: free, and outside the range that other programs'
outgoing connections draw their source ports from (so none can take it first)."""

import socket

from gsi_jax.runtime import distributed


def test_the_port_lies_below_the_ephemeral_range_and_is_free():
  low, _ = distributed.ephemeral_range()
  port = distributed.coordinator_port()
  assert 1024 <= port < low
  assert not distributed.port_held(port)


def test_above_the_range_where_too_few_ports_lie_below(monkeypatch):
  monkeypatch.setattr(distributed, "ephemeral_range", lambda: (1500, 50000))
  assert 50000 < distributed.coordinator_port() < 65536


class Draws:
  """An rng that draws the given ports in turn."""

  def __init__(self, *ports):
    self.ports = list(ports)

  def choice(self, _):
    return self.ports.pop(0)


def test_a_held_port_is_passed_over():
  with socket.socket() as holder:
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    held = holder.getsockname()[1]
    free = distributed.coordinator_port()
    assert distributed.port_held(held)
    assert distributed.coordinator_port(Draws(held, free)) == free
