"""absl entry points: flags → a frozen config → one library call → write.

Nothing here registers flags on import: a script calls `define_experiment_flags()`
(or defines its own) at its top level.  Bad input exits 2 with one `error:` line; Ctrl-C
(SIGINT) or SIGTERM ends a run with one `interrupted:` line and exit status 130 or 143,
before it writes its outputs.
"""

from __future__ import annotations

import _thread
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Callable

from absl import app, flags

from gsi_jax import experiment, text
from gsi_jax.measure import provenance
from gsi_jax.runtime import distributed, supervisor
from gsi_jax.errors import GSIError
from gsi_jax.gsi import calibration
from gsi_jax.gsi.cache import DEFAULT_BASES_DIR
from gsi_jax.loading import DEFAULT_MODEL

FLAGS = flags.FLAGS


def fail(message: str) -> None:
  distributed.say(f"error: {message}")
  distributed.leave(2)


INTERRUPTED_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}  # the shell's 128 + signal
_interrupted = threading.Event()  # a signal came
_interrupt_taken = threading.Event()  # the run has reached its interrupted ending
_redelivering = threading.Event()  # the handler's next call is the interrupt raised again
_interrupt_status = [130]
REDELIVER_S = 0.5


def _interrupt(signum, frame):
  """The first SIGINT or SIGTERM interrupts the main thread; a second one ends the process
  at once (as a second Ctrl-C does), for a run that does not get to its interrupted line."""
  del frame
  if _redelivering.is_set():
    _redelivering.clear()
    raise KeyboardInterrupt
  if _interrupted.is_set():
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return
  _interrupted.set()
  _interrupt_status[0] = INTERRUPTED_STATUS[signum]
  threading.Thread(target=_raise_until_taken, args=(signum,), daemon=True).start()
  raise KeyboardInterrupt


def _raise_until_taken(signum: int) -> None:
  """The interrupt raised again every REDELIVER_S until the run takes it.  A signal
  handler's exception can land where it is lost: inside a gc callback or a finalizer (jax
  runs one at every collection), where Python only reports it, or in native code that
  drops it; the run would go on as if never interrupted."""
  while not _interrupt_taken.wait(REDELIVER_S):
    _redelivering.set()
    _thread.interrupt_main(signum)


def handle_signals(restore: bool) -> None:
  """SIGINT and SIGTERM interrupt the run.  A disposition the process inherited as ignored
  (a background job of a non-interactive shell ignores SIGINT) stays, unless `restore`: a
  supervised worker, whose supervisor forwards the signals it is sent, takes both.  Called
  again once the processes have joined: jaxlib's preemption notifier takes SIGTERM then."""
  for signum in INTERRUPTED_STATUS:
    if restore or signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler,
                                               _interrupt):
      signal.signal(signum, _interrupt)


def _end_interrupted() -> None:
  status = _interrupt_status[0]
  distributed.report_interrupt(status)
  distributed.say(interrupted_message())
  distributed.leave(status)


def _parse(argv):
  try:
    return FLAGS(argv)
  except flags.Error as e:
    fail(str(e))


def _unraisable(hook):
  """Python's report of an exception it could not raise, less two that are not the user's
  concern: the interrupt, lost inside a gc callback or a finalizer (`_raise_until_taken`
  raises it again), and orbax's background thread's "Event loop is closed" once a restore
  has ended (seen after restoring damaged checkpoints)."""
  def filtered(unraisable):
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _interrupted.is_set():
      return
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and "Event loop is closed" in str(unraisable.exc_value)):
      hook(unraisable)
  return filtered


def define_process_flags() -> None:
  """How a process joins the others (gsi_jax.runtime.distributed); every script has them."""
  if "coordinator_address" in FLAGS:
    return
  flags.DEFINE_string("coordinator_address", "", "host:port of process 0, to run as one of "
                      "--num_processes processes ('' = one process).")
  flags.DEFINE_integer("num_processes", None, "Processes in the run (with --coordinator_address).")
  flags.DEFINE_integer("process_id", None, "This process's index, 0..num_processes-1.")
  flags.DEFINE_bool("distributed_auto", False, "Join the processes of a cluster job (SLURM, "
                    "Open MPI, ...) as jax.distributed.initialize() detects them.")
  flags.DEFINE_integer("process_timeout_s", 60, "A process that has not joined, or stops "
                       "answering, by then ends every process of the run.")


def process_config() -> distributed.ProcessConfig:
  return distributed.ProcessConfig(
      coordinator_address=FLAGS.coordinator_address, num_processes=FLAGS.num_processes,
      process_id=FLAGS.process_id, auto=FLAGS.distributed_auto,
      timeout_s=FLAGS.process_timeout_s)


def _supervise(config: distributed.ProcessConfig) -> int:
  """This process of several runs as a supervised child (gsi_jax.runtime.supervisor)."""
  process = "auto" if config.process_id is None else str(config.process_id)
  out = FLAGS["out"].value if "out" in FLAGS else None
  script = os.path.splitext(os.path.basename(sys.argv[0]))[0]
  return supervisor.supervise(process, config.num_processes,
                              supervisor.log_path(out, script, process),
                              config.coordinator_address)


def _join(config: distributed.ProcessConfig) -> None:
  """Join the other processes, then refuse any whose flags differ from process 0's."""
  distributed.initialize(config)
  handle_signals(restore=supervisor.is_child())
  distributed.check_count(config.num_processes)
  own = {"process_id", "coordinator_address", "num_processes", "distributed_auto"}
  ours = {f.name: f.value for module, defined in FLAGS.flags_by_module_dict().items()
          if not module.startswith("absl") for f in defined if f.name not in own}
  distributed.agree({**ours, "script": os.path.basename(sys.argv[0])})


def run(main: Callable, one_process: str | None = None) -> None:
  """app.run with project errors turned into `error: ...` and exit status 2; --help exits 0.

  With --coordinator_address (or --distributed_auto) the script runs as one of several
  processes: each is supervised, they join, and their flags must agree, before main runs.
  A script that measures one device says why in `one_process`, and is refused there.
  """
  sys.unraisablehook = _unraisable(sys.unraisablehook)
  if supervisor.is_child():
    supervisor.bind_to_supervisor()
  handle_signals(restore=supervisor.is_child())
  define_process_flags()
  if any(a in ("--help", "-h", "--helpfull", "-?") for a in sys.argv[1:]):
    print((sys.modules["__main__"].__doc__ or "").strip() + "\n")
    for module in ("__main__", __name__):
      print(FLAGS.module_help(module))
    sys.exit(0)

  def wrapped(argv):
    if len(argv) > 1:
      fail(f"unexpected arguments {argv[1:]}; all options are --flags")
    for noisy in ("jax", "orbax", "absl", "httpx"):
      logging.getLogger(noisy).setLevel(logging.WARNING)
    # Orbax's background tasks log a failed write's traceback through asyncio ("Task
    # exception was never retrieved"); the failure itself reaches the user as one line.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    try:
      config = process_config()
    except GSIError as e:
      fail(str(e))
    if config.joins and one_process:
      fail(f"{os.path.basename(sys.argv[0])} {one_process}: run it as one process, without "
           "--coordinator_address and --distributed_auto")
    if config.joins and not supervisor.is_child():
      sys.exit(_supervise(config))
    try:
      try:
        _join(config)
        logging.info("running on %s", provenance.device_text())
        main(argv)
      except GSIError as e:
        distributed.report_failure(str(e))
        fail(str(e))
      except Exception as e:  # a peer gone, or a bug: its traceback, and the others told to end
        if not distributed.joined():
          raise
        if _interrupted.is_set():  # this process's own signal, while the runtime held it
          raise KeyboardInterrupt from None
        peer = distributed.interrupted_peer()  # a peer interrupted, and gone
        if peer:
          distributed.say(peer[0])
          distributed.leave(peer[1])
        lost = distributed.lost_peer(e)
        if lost:
          fail(lost)
        distributed.report_failure(f"{type(e).__name__}: {e}")
        if not distributed.has_said():  # else this process already said why it ends
          traceback.print_exc()
        distributed.leave(1)
    except KeyboardInterrupt:
      _interrupt_taken.set()
      _end_interrupted()
  app.run(wrapped, flags_parser=_parse)


def interrupted_message() -> str:
  """One line on Ctrl-C: what is kept, and how to go on."""
  partial = sorted(experiment.PARTIAL_WRITES)
  kept = [f"the rows finished so far are in {', '.join(partial)} (\"complete\": false)"] \
      if partial else []
  if calibration.RESUMABLE:
    kept.append(f"the calibrated layers are kept in {', '.join(sorted(calibration.RESUMABLE))}"
                " and the same command resumes after them")
  return "interrupted: " + ("; ".join(kept) if kept else
                            "nothing partial was written (outputs are written whole)")


def preset_or_flag(preset: dict | None):
  """pick(name, flag): the flag's value, or preset[name] where the preset names it and the
  command line left the flag unset (a benchmark's --dry sizes; None: no preset)."""
  preset = preset or {}
  return lambda name, flag: preset[name] if name in preset and not flag.present else flag.value


def numbers(name: str, values, cast) -> tuple:
  """A comma-list flag as numbers, or one error line naming the flag."""
  try:
    out = tuple(cast(v) for v in values)
  except (TypeError, ValueError):
    raise GSIError(f"--{name} must be a comma list of numbers, got {','.join(values)}") from None
  if not out:
    raise GSIError(f"--{name} is empty")
  return out


def define_knob_flags(knobs) -> None:
  """A flag per method knob ({name: gsi_jax.methods.Knob}): a comma list, or one number or
  name.  Idempotent: a knob whose flag exists is skipped (tests run scripts in process)."""
  for name, knob in knobs.items():
    if name in flags.FLAGS:
      continue
    if knob.many:
      flags.DEFINE_list(name, list(knob.default), knob.help)
    else:
      define = {int: flags.DEFINE_integer, float: flags.DEFINE_float}.get(knob.cast,
                                                                          flags.DEFINE_string)
      define(name, knob.default, knob.help)


def knob_value(knob, raw):
  """A method knob's flag value as its grid holds it (a tuple for a list), checked."""
  if not knob.many:
    value = raw
  elif not raw and knob.may_be_empty:
    value = ()
  elif knob.cast is str:
    value = tuple(raw)
  else:
    value = numbers(knob.name, raw, knob.cast)
  return knob.checked(tuple(sorted(value)) if knob.many and knob.sort else value)


def define_experiment_flags(**defaults) -> None:
  """The flags every experiment shares; `defaults` override their defaults by name.

  Idempotent (tests run several scripts in one process): a flag already defined
  only takes the overridden default.
  """
  if "eval_tokens" in FLAGS:
    for name, value in defaults.items():
      FLAGS.set_default(name, value)
    return
  d = {"model": DEFAULT_MODEL, "k": ["128", "256", "384"], "eps": ["0.05", "0.1", "0.2"],
       "mode": ["gated"], "impl": "auto", "dtype": "float32",
       "calib_text_file": text.PYDOC_CALIB, "eval_text_file": text.PYDOC_EVAL,
       "calib_tokens": 16384, "eval_tokens": 8192, "seq_len": 256, "method": "eigh",
       "bases_dir": DEFAULT_BASES_DIR, "prompts_file": None, "max_new_tokens": 50, "out": None,
       **defaults}
  flags.DEFINE_string("model", d["model"], "Preset, .gguf path, HF folder or hub id.")
  flags.DEFINE_list("k", d["k"], "Subspace ranks (comma list).")
  flags.DEFINE_list("eps", d["eps"], "Gate thresholds on rho = |r|/|x| (comma list; inf allowed).")
  flags.DEFINE_list("mode", d["mode"], "Gate modes: gated, static, dense (comma list).")
  flags.DEFINE_string("impl", d["impl"], "Fast paths: auto (the kernels on a GPU, XLA on cpu), "
                      "xla, or pallas (the kernels everywhere, interpreted on cpu).")
  flags.DEFINE_string("dtype", d["dtype"], "Weights: float32, bfloat16 or float16.")
  flags.DEFINE_string("calib_text_file", d["calib_text_file"],
                      "Calibration text (file, pydoc:calibration, hf:dataset/config/split).")
  flags.DEFINE_string("eval_text_file", d["eval_text_file"], "Held-out evaluation text.")
  flags.DEFINE_integer("calib_tokens", d["calib_tokens"], "Calibration tokens.")
  flags.DEFINE_integer("eval_tokens", d["eval_tokens"], "Evaluation tokens.")
  flags.DEFINE_integer("seq_len", d["seq_len"], "Window length in tokens.")
  flags.DEFINE_string("method", d["method"], "Calibration method: eigh, krylov or cascade.")
  flags.DEFINE_string("bases_dir", d["bases_dir"], "Orbax bases cache ('' to disable).")
  flags.DEFINE_string("prompts_file", d["prompts_file"], "One prompt per line.")
  flags.DEFINE_integer("max_new_tokens", d["max_new_tokens"], "Tokens generated per prompt.")
  flags.DEFINE_string("out", d["out"], "JSON output path (default: the script's file under "
                      f"{experiment.RUNS_DIR}/; with --commit, under {experiment.COMMITTED_DIR}/).")
  if "commit" not in FLAGS:  # notebooks/execute.py's flag of the same meaning, in one process
    flags.DEFINE_bool("commit", False, "Rewrite the committed result this script writes under "
                      f"{experiment.COMMITTED_DIR}/ (which RESULTS.md cites), as make results "
                      f"does, instead of writing under {experiment.RUNS_DIR}/.")


def output_path(committed: str) -> str:
  """--out, else the committed path with --commit, else its twin under the run folder; ''
  for a script that writes nothing unless told (committed='')."""
  if FLAGS.out and FLAGS.commit:
    raise GSIError("--out and --commit name two places; give one (--commit writes "
                   f"{committed or 'nothing for this script'})")
  if FLAGS.out or not committed:
    if FLAGS.commit:
      raise GSIError("--commit: this script has no committed output; give --out")
    return FLAGS.out or ""
  out = committed if FLAGS.commit else experiment.run_path(committed)
  logging.info("writing %s%s", out, "" if FLAGS.commit else
               f" (--commit rewrites the committed {committed})")
  return out


def experiment_config(default_out: str) -> experiment.ExperimentConfig:
  """The shared flags as a checked, frozen config (before any compute)."""
  return experiment.ExperimentConfig(
      model=FLAGS.model, k=numbers("k", FLAGS.k, int), eps=numbers("eps", FLAGS.eps, float),
      mode=tuple(FLAGS.mode), impl=FLAGS.impl, dtype=FLAGS.dtype,
      calib_text_file=FLAGS.calib_text_file, eval_text_file=FLAGS.eval_text_file,
      calib_tokens=FLAGS.calib_tokens, eval_tokens=FLAGS.eval_tokens, seq_len=FLAGS.seq_len,
      method=FLAGS.method, bases_dir=FLAGS.bases_dir,
      prompts=experiment.read_prompts(FLAGS.prompts_file), prompts_file=FLAGS.prompts_file,
      max_new_tokens=FLAGS.max_new_tokens, out=output_path(default_out))
