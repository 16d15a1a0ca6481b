"""Kernels a decoded token launches on an H200, per decode program, from XLA's own GPU
compiler run on this CPU (gsi_jax/gpu/launches.py): GPT-J-6B's shape, bf16, 1, 4 and 16
sequences.  Compiled, not run.

  make gpu-launches        # installs jax's CUDA plugin beside .venv-jax011, then runs this
  JAX_PLATFORMS=cpu PYTHONPATH=.venv-jax011/xla-gpu:. .venv-jax011/bin/python \\
      benchmarks/gpu_launches.py --layers 2 --batch 1 --out /tmp/launches.json

Each program is compiled at --layers blocks (28, GPT-J-6B's depth: XLA fuses the layers'
copies differently along the stack, so a count at a smaller depth does not scale to it).
Each record: kernels a token (always run, and with the larger branch of every conditional),
conditionals, command buffers, kernels by kind, the ratio to dense at the same batch,
compile seconds.  `check` holds each program's counts at --check_layers blocks and at 1 and
4 sequences (CHECK_BATCHES), which tests/test_gpu_launches.py compiles again: a change to
the code that moves a count fails it until this JSON is written anew.  `fit` holds each
program's counts and compile seconds at --fit_layers blocks and one sequence: the depth
gpu_check.sh decodes at, whose times gpu_summary.py fits a kernel's cost to.
`launch_floor`: the launch floor's programs (`benchmarking.chained_calls`, which
gpu_kernel.py times on a GPU), each one command buffer holding all its calls.  The JSON is
rewritten after each program, "complete": false until the last.
"""

import dataclasses
import logging
import os
import tempfile
import time

from absl import flags

from gsi_jax import cli, experiment
from gsi_jax.measure.benchmarking import LAUNCH_FLOOR_CALLS, LAUNCH_FLOOR_KINDS
from gsi_jax.errors import GSIError
from gsi_jax.gpu import launches
from gsi_jax.models import ModelConfig

_LAYERS = flags.DEFINE_integer("layers", 28, "Blocks compiled (28: GPT-J-6B's depth).")
_CHECK_LAYERS = flags.DEFINE_integer("check_layers", 2, "Blocks of the small programs a test "
                                     "compiles again (at CHECK_BATCHES; 0: none).")
# The sequences of the small programs: one, and several (the kernel's padded token block).
CHECK_BATCHES = (1, 4)
_FIT_LAYERS = flags.DEFINE_integer("fit_layers", 4, "Blocks of the decode programs "
                                   "benchmarks/gpu_check.sh times (0: none counted).")
_BATCH = flags.DEFINE_list("batch", ["1", "4", "16"], "Sequences decoded at once.")
_PROGRAMS = flags.DEFINE_list("programs", list(launches.PROGRAMS), "Decode programs.")
_OUT = flags.DEFINE_string("out", "results/benchmarks/gpu_launches.json", "JSON output.")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  layers: int
  check_layers: int
  fit_layers: int
  batches: tuple[int, ...]
  programs: tuple[str, ...]
  out: str

  def __post_init__(self):
    full = ModelConfig.gptj_6b().n_layers
    for flag, value, low in (("--layers", self.layers, 1), ("--check_layers", self.check_layers, 0),
                             ("--fit_layers", self.fit_layers, 0)):
      if not low <= value <= full:
        raise GSIError(f"{flag} must lie in [{low}, {full}], got {value}")
    for b in self.batches:
      experiment.positive("--batch values", b)
    unknown = sorted(set(self.programs) - set(launches.PROGRAMS))
    if unknown or not self.programs:
      raise GSIError(f"--programs: unknown {unknown or 'none given'}; choose from "
                     f"{', '.join(launches.PROGRAMS)}")
    if "dense" not in self.programs:
      raise GSIError("--programs must include dense: every count is read against it")


def count(name: str, batch: int, layers: int) -> tuple[dict, float]:
  """(launches of one decoded token at `layers` blocks, compile seconds)."""
  config = dataclasses.replace(ModelConfig.gptj_6b(), n_layers=layers)
  with tempfile.TemporaryDirectory() as dump:
    start = time.perf_counter()
    launches.compile_generate(config, name, batch, dump)
    seconds = time.perf_counter() - start
    return launches.dumped_launches(dump).as_dict(), seconds


def main(argv):
  del argv
  c = LaunchConfig(_LAYERS.value, _CHECK_LAYERS.value, _FIT_LAYERS.value,
                   cli.numbers("batch", _BATCH.value, int),
                   tuple(_PROGRAMS.value), experiment.check_output_path(_OUT.value))
  launches.compile_only_mesh()  # the plugin and the toolkit, before any compile
  launches.cuda_data_dir()
  records, check, fit, floor = [], [], [], {"calls": LAUNCH_FLOOR_CALLS}

  def write(complete: bool):
    experiment.write_json(c.out, {
        "what": "compiled on a CPU for an H200 by XLA's GPU pipeline, not run",
        "shape": "gptj-6b", "dtype": "bfloat16", "layers": c.layers,
        "plugin": list(launches.PLUGIN), "launch_floor": floor, "records": records,
        "check": {"layers": c.check_layers, "batches": list(CHECK_BATCHES), "records": check},
        "fit": {"layers": c.fit_layers, "batch": 1, "records": fit}},
        partial=not complete)

  for kind in LAUNCH_FLOOR_KINDS:
    with tempfile.TemporaryDirectory() as dump:
      floor[kind] = launches.launch_floor_buffers(kind, dump)
    logging.info("launch floor, %s: %d command buffer(s) of %s kernels, %d outside", kind,
                 floor[kind]["command_buffers"], floor[kind]["kernels_in_buffers"],
                 floor[kind]["kernels_outside"])

  for batch in c.batches:
    for name in (["dense"] + [p for p in c.programs if p != "dense"]):
      counted, seconds = count(name, batch, c.layers)
      rec = {"program": name, "batch": batch, **counted, "compile_s": seconds}
      dense = next(r for r in records if r["program"] == "dense" and r["batch"] == batch) \
          if name != "dense" else rec
      for key in ("kernels", "kernels_with_larger_branches"):
        rec[f"{key}_over_dense"] = rec[key] / dense["kernels"]
      records.append(rec)
      logging.info("%s, %d sequences: %d kernels a token (%d with the larger branches, "
                   "%.2fx dense), %d conditionals; compiled in %.1f s", name, batch,
                   rec["kernels"], rec["kernels_with_larger_branches"],
                   rec["kernels_with_larger_branches_over_dense"], rec["conditionals"], seconds)
      write(complete=False)
  for batch in CHECK_BATCHES if c.check_layers else ():
    for name in c.programs:
      counted, _ = count(name, batch, c.check_layers)
      check.append({"program": name, "batch": batch, **counted})
      write(complete=False)
  for name in c.programs if c.fit_layers else ():  # what gpu_summary fits a kernel's cost by
    counted, seconds = count(name, 1, c.fit_layers)
    fit.append({"program": name, **counted, "compile_s": seconds})
    write(complete=False)
  write(complete=True)


if __name__ == "__main__":
  cli.run(main, one_process="compiles for one device")
