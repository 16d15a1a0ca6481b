"""Start N real processes on 127.0.0.1 (gloo) and collect what each wrote.

`launch` runs `python -m tests.multiprocess --mode=... ` once per process, each with its
own --process_id, bounded in time and stopped by PID.  The worker below calibrates,
restores and decodes through the library, as a user's script would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np

from gsi_jax.runtime.distributed import coordinator_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALIB = (np.arange(192, dtype=np.int32) * 7 % 97 + 1).reshape(-1, 16)
PROMPT = np.array([[3, 17, 5, 40, 22]], np.int32)
K, EPS, NEW_TOKENS = 8, 0.5, 6

# One of absl's INFO lines ("I1206 06:34:41.536372 140676 cli.py:164] ..."), which a test of a
# process's closing line sets aside.
ABSL_INFO = re.compile(r"I\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")


def start(args: list[str], n: int = 2, skip: tuple[int, ...] = (),
          extra: dict[int, list[str]] | None = None,
          program: tuple[str, ...] = ("-m", "tests.multiprocess"),
          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          port: int | None = None) -> dict[int, subprocess.Popen]:
  """The processes of one run, by process id: those in `skip` are never started; `extra`
  adds flags to some; `program` is what python runs (this worker, or a script of the
  repository); `stdout` and `stderr` map a process id to where its output goes, or are
  subprocess.PIPE; `port`: the coordinator's (default: a free one)."""
  port = port or coordinator_port()
  procs = {}
  for pid in range(n):
    if pid in skip:
      continue
    cmd = [sys.executable, *program, *args, *(extra or {}).get(pid, []),
           f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={n}",
           f"--process_id={pid}"]
    procs[pid] = subprocess.Popen(
        cmd, cwd=ROOT, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=stdout if stdout == subprocess.PIPE else stdout[pid],
        stderr=stderr if stderr == subprocess.PIPE else stderr[pid])
  return procs


def launch(args: list[str], n: int = 2, timeout: float = 240, skip: tuple[int, ...] = (),
           extra: dict[int, list[str]] | None = None,
           program: tuple[str, ...] = ("-m", "tests.multiprocess"),
           port: int | None = None) -> list[tuple]:
  """(returncode, stdout, stderr) per process (returncode None: stopped at `timeout`)."""
  procs = start(args, n, skip, extra, program, port=port)
  deadline, out = time.monotonic() + timeout, {}
  for pid, p in procs.items():
    try:
      stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
      out[pid] = (p.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
      for q in procs.values():  # past the bound: stop every process, keep what it printed
        if q.poll() is None:
          q.kill()
      stdout, stderr = p.communicate()
      out[pid] = (None, stdout, stderr)
  return [out[pid] for pid in sorted(procs)]


def reference(model, bases):
  """What one process computes: the GSI model's logits and greedy tokens."""
  import gsi_jax
  params = gsi_jax.apply_gsi(model.params, bases, K)
  gate = gsi_jax.make_gate(EPS)
  logits = np.asarray(model.logits(params, PROMPT, gate))
  tokens = np.asarray(model.generate(params, PROMPT, NEW_TOKENS, gate, stop_at_eos=False))
  return logits, tokens


HOLD_S = 300  # how long a held process waits to be killed


def hold(phase: str) -> None:
  """Say where this process stands, then wait there to be killed."""
  print(f"holding at {phase}", flush=True)
  time.sleep(HOLD_S)


def main(argv):
  """--mode=calibrate (on the global mesh) or restore, then decode; or --mode=load, the
  weights alone; writes into --out_dir."""
  del argv
  import jax
  from absl import flags

  import gsi_jax
  from gsi_jax.runtime import distributed, sharding
  mode, out = flags.FLAGS.mode, flags.FLAGS.out_dir
  mesh = sharding.make_mesh()
  model = gsi_jax.load_model(flags.FLAGS.model_path, mesh=mesh)
  if mode == "load":  # what this process read, against its share of the weights
    share = sum(leaf.nbytes // (1 if leaf.sharding.is_fully_replicated else jax.device_count())
                for leaf in jax.tree.leaves(model.params))
    np.savez(os.path.join(out, f"process{jax.process_index()}.npz"),
             bytes_read=model.bytes_read, share=share,
             logits=distributed.host_copy(model.logits(model.params, PROMPT)))
    print("done", jax.process_index(), flush=True)
    return
  hold_at = flags.FLAGS.hold_at
  holds = hold_at and flags.FLAGS.die_process in (None, jax.process_index())
  if holds and hold_at in ("calibration", "save"):  # wait there, once its first save is done
    from gsi_jax.gsi import checkpoint
    owner, name = ((checkpoint.LayerProgress, "save") if hold_at == "calibration"
                   else (checkpoint, "_save"))
    inner = getattr(owner, name)

    def save_then_hold(*a, **kw):
      inner(*a, **kw)
      hold(hold_at)
    setattr(owner, name, save_then_hold)
  if mode == "calibrate":
    stop_after = flags.FLAGS.stop_after_layer
    dies = flags.FLAGS.die_process in (None, jax.process_index())
    if stop_after >= 0 and dies:  # a crash once that layer is saved, as kill -9 would
      from gsi_jax.gsi import checkpoint
      save = checkpoint.LayerProgress.save

      def save_then_die(self, index, *a):
        save(self, index, *a)
        if index == stop_after:
          os._exit(9)
      checkpoint.LayerProgress.save = save_then_die
    bases = gsi_jax.calibrate(model, model.params, CALIB, K, method=flags.FLAGS.method,
                              seq_len=16, resume_dir=os.path.join(out, "progress"), mesh=mesh,
                              progress=True)
    gsi_jax.save_bases(os.path.join(out, "bases"), bases)
  else:
    bases = gsi_jax.load_bases(os.path.join(out, "bases"))
  params = sharding.shard_params(gsi_jax.apply_gsi(model.params, bases, K), mesh)
  gate = gsi_jax.make_gate(EPS)
  if hold_at == "compute":  # inside one XLA computation, where a Python handler waits
    import jax.numpy as jnp
    print("holding at compute", flush=True)
    step = lambda _, v: v * 1.0000001 + 1e-9  # noqa: E731
    spin = jax.jit(lambda v: jax.lax.fori_loop(
        0, 1000, lambda _, w: jax.lax.fori_loop(0, 100_000_000, step, w), v))
    spin(jnp.float32(1)).block_until_ready()  # about 400 s on a CPU core
  if hold_at == "decode":  # every process decodes until one of them is killed
    print("holding at decode", flush=True)
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:
      model.generate(params, PROMPT, NEW_TOKENS, gate, stop_at_eos=False).block_until_ready()
  logits = distributed.host_copy(model.logits(params, PROMPT, gate))
  tokens = distributed.host_copy(model.generate(params, PROMPT, NEW_TOKENS, gate,
                                                stop_at_eos=False))
  np.savez(os.path.join(out, f"process{jax.process_index()}.npz"), logits=logits,
           tokens=tokens, devices=jax.device_count(),
           **{f"V/{layer}/{site}": v for layer, sites in bases.vectors.items()
              for site, v in sites.items()})
  print("done", jax.process_index(), flush=True)


if __name__ == "__main__":
  from absl import flags

  from gsi_jax import cli
  flags.DEFINE_enum("mode", "calibrate", ["calibrate", "restore", "load"], "What to run.")
  flags.DEFINE_string("model_path", None, "Model folder.")
  flags.DEFINE_string("out_dir", None, "Where bases, progress and results go.")
  flags.DEFINE_string("method", "eigh", "Calibration method.")
  flags.DEFINE_integer("stop_after_layer", -1, "Die once this layer's progress is saved.")
  flags.DEFINE_integer("die_process", None, "Only this process dies or holds (default: all).")
  flags.DEFINE_enum("hold_at", None, ["calibration", "save", "compute", "decode"],
                    "Wait inside this phase, to be killed there.")
  cli.run(main)
