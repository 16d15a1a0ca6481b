"""What this CPU can show of the GPU path: lowering for cuda, rocm and tpu, and GPU binaries.

  python benchmarks/gpu_lowering.py --out results/benchmarks/gpu_lowering.json

1. The kernel at every map shape of the paper's models (`programs.PAPER_MODELS`), bf16
   and f32, 1 to 2048 tokens, exported for each platform (`jax.export`): kernel calls,
   other custom calls, interpret-mode loops, and the launch against the tile plan.
2. The default model's forward and decode step exported for cuda, rocm and tpu: kernel
   calls against gated sites and maps.
3. GPT-J's gated sites exported as a model runs them (`gated_linear`), at 1 and 16 tokens:
   launches per site, and the decode tiles against Little's law (`tiling.bytes_in_flight`).
4. Every GPU tile plan compiled with PyPI's `triton` for sm_90 and gfx942: registers,
   spills, shared memory; and the kept-rows and kept-dots kernels at Llama-3-8B's gate
   and up.
Lowered and compiled, not run: numerics and speed need a GPU (benchmarks/gpu_check.sh).

  python benchmarks/gpu_lowering.py --export_dir DIR

instead writes every method's programs for reading: the first point of each method of
`pareto.py` (and dense) on --model (the default model; --layers N: its first N blocks) at
small settings (--k 128, eps 0.1, --calib_tokens 2048, the first value of each knob, ranks
capped at k / 2, two learning steps, one search generation), its forward and decode step
exported for cuda and rocm as DIR/<method>-<platform>-<phase>.mlir (StableHLO text), and
DIR/programs.json: each program's kernel calls against the sites its fast path serves,
and its CPU-only calls (`gsi_jax.methods.programs`).
"""

import dataclasses
import logging
import os

import jax
from absl import flags

from gsi_jax import cli, experiment, methods
from gsi_jax.gpu import binaries, programs
from gsi_jax.errors import GSIError
from gsi_jax.experiment import ExperimentConfig
from gsi_jax.gsi.cache import cached_bases
from gsi_jax.loading.load import first_blocks
from gsi_jax.methods.context import Context
from gsi_jax.methods.evaluate import Evaluator
from gsi_jax.methods.programs import export_methods
from gsi_jax.models import ModelConfig
from gsi_jax.ops import tiling

_OUT = flags.DEFINE_string("out", "results/benchmarks/gpu_lowering.json", "JSON output.")
_EXPORT_DIR = flags.DEFINE_string("export_dir", None, "Write every method's exported programs "
                                  "here (StableHLO text and programs.json) instead of the "
                                  "lowering checks.")
_MODEL = flags.DEFINE_string("model", experiment.DEFAULT_MODEL, "--export_dir's model.")
_K = flags.DEFINE_integer("k", 128, "--export_dir's GSI rank.")
_CALIB_TOKENS = flags.DEFINE_integer("calib_tokens", 2048, "--export_dir's calibration tokens.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "--export_dir's window length.")
_LAYERS = flags.DEFINE_integer("layers", 4, "--export_dir's model cut to its first N blocks "
                               "(0: all); every block exports alike.")

# --export_dir's small settings: one point a method, a few steps where a method learns.
EXPORT_KNOBS = {"learned_steps": 2, "rsparse_search_population": 3,
                "rsparse_search_parents": 2, "rsparse_search_generations": 1,
                "rsparse_search_windows": 1, "greedy_windows": 1}
RANK_KNOBS = ("ladder", "svd_ranks", "head_k", "residual_k", "rsparse_ranks",
              "learned_residual_k", "learned_rank_max", "output_sketch")


@dataclasses.dataclass(frozen=True)
class ExportConfig:
  """The experiment every method's first point is built in, and the grid of its knobs."""
  experiment: ExperimentConfig
  grid: dict
  out_dir: str
  layers: int = 4

  def __post_init__(self):
    if self.layers < 0:
      raise GSIError(f"--layers must be >= 0 (0: every block), got {self.layers}")


def export_config(out_dir: str, model: str, k: int, calib_tokens: int, seq_len: int,
                  layers: int) -> ExportConfig:
  grid = {}
  for name, knob in methods.knobs().items():
    value = EXPORT_KNOBS.get(name, knob.default)
    grid[name] = cli.knob_value(knob, value[:1] if knob.many else value)
  cap = lambda rank: min(rank, max(1, k // 2))  # ranks and sketches below k, on any model
  for name in RANK_KNOBS:
    grid[name] = tuple(map(cap, grid[name])) if isinstance(grid[name], tuple) \
        else cap(grid[name])
  return ExportConfig(ExperimentConfig(model=model, k=(k,), eps=(0.1,), impl="auto",
                                       calib_tokens=calib_tokens, eval_tokens=2 * seq_len,
                                       seq_len=seq_len, max_new_tokens=2, prompts=("Hello",)),
                      grid, out_dir, layers)


def export_programs(c: ExportConfig, save=lambda rows: None) -> list[dict]:
  """Every method's programs; save(rows) after each, so a stopped run keeps its rows."""
  s = experiment.prepare(c.experiment, bases=False)
  s.model = first_blocks(s.model, c.layers)
  e = c.experiment
  s.bases = cached_bases(s.model, s.model.params, s.calib, e.k_max, e.method,
                         e.bases_dir or None)
  ctx = Context(Evaluator(s, speed_repeats=0), c.experiment, c.grid, lambda name: True)
  rows = []

  def progress(r):
    logging.info("%s %s %s: %d kernel calls, %d fast sites, CPU-only %s: %s", r["method"],
                 r["platform"], r["phase"], r["kernel_calls"], r["fast_sites"],
                 r["cpu_only_calls"] or "none", "ok" if r["passed"] else "FAILED")
    rows.append(r)
    save(rows)
  return export_methods(ctx, c.out_dir, progress=progress)


def map_summary(records) -> dict:
  out = {}
  for platform in tiling.PLATFORMS:
    rows = [r for r in records if r["platform"] == platform]
    ok = [r for r in rows if (r["kernel_calls"], r["other_calls"], r["interpreter_loops"])
          == (1, [], 0)]
    as_planned = [r for r in rows if "launches" not in r or r["launches"] ==
                  [{"grid": r["planned_grid"], **r["planned_launch"]}]]
    out[platform] = {"cases": len(rows), "one_kernel_call_no_loop": len(ok),
                     "launched_as_planned": len(as_planned)}
  return out


def main(argv):
  del argv
  # --export_dir's flags are checked with the others, whether or not it is given.
  c = export_config(_EXPORT_DIR.value, _MODEL.value, _K.value, _CALIB_TOKENS.value,
                    _SEQ_LEN.value, _LAYERS.value)
  if _EXPORT_DIR.value:
    out = experiment.check_output_path(os.path.join(c.out_dir, "programs.json"),
                                       "--export_dir")
    record = lambda rows: {"what": "exported on a CPU, not run", "layers": c.layers,
                           "jax_version": jax.__version__, "grid": c.grid,
                           "experiment": dataclasses.asdict(c.experiment),
                           "passed": sum(r["passed"] for r in rows), "programs": rows}
    rows = export_programs(c, lambda rows: experiment.write_json(out, record(rows), partial=True))
    experiment.write_json(out, record(rows))
    return
  out = experiment.check_output_path(_OUT.value)
  triton = binaries.cpu_triton()  # before any compute
  maps = programs.paper_maps()
  records = []
  for platform in tiling.PLATFORMS:
    for d, d_out, transposed in maps:
      for tokens in programs.LOWERING_TOKENS:
        for dtype in programs.LOWERING_DTYPES:
          records.append(programs.lower_map(platform, tokens, d, d_out, dtype, transposed))
    logging.info("%s: %d map cases lowered", platform, len(maps) * 8)
  default = ModelConfig.smollm2_135m()
  models = [programs.lower_model(default, platform, impl, head_k)
            for platform in ("cuda", "rocm", "tpu")
            for impl, head_k in (("pallas", 0), ("pallas", 256), ("auto", 0))]
  for m in models:
    logging.info("%s %s head=%s: %d gated maps, %d / %d kernel calls (forward / decode step)",
                 m["platform"], m["impl"], m["gated_head"], m["gated_maps"],
                 m["forward_kernel_calls"], m["decode_step_kernel_calls"])
  sites = [r for platform in programs.ARCHES for tokens in (1, 16)
           for r in programs.gptj_site_launches(platform, tokens)]
  for r in sites:
    logging.info("GPT-J %s, %s, %d tokens: %d launches, other ops %s", r["site"],
                 r["platform"], r["tokens"], r["launches"], r["other_ops"] or "none")
  show = lambda r: logging.info(
      "%s %s %s %s T=%d d=%d O=%s: %d registers, %d B spilled, %d B shared, grid %s",
      r["platform"], r["arch"], r["regime"], r["dtype"], r["tokens"], r["d"], r["out"],
      r["registers"], r["spill_bytes"], r["shared_bytes"], r["grid"])
  compiled = binaries.plan_binaries(progress=show)
  experiment.write_json(out, {
      "jax_version": jax.__version__, "triton_version": triton.__version__,
      "what": "lowered and compiled on a CPU, not run",
      "maps": {"models": [c.name for c in programs.PAPER_MODELS], "shapes": len(maps),
               "tokens": list(programs.LOWERING_TOKENS),
               "dtypes": list(programs.LOWERING_DTYPES), "by_platform": map_summary(records)},
      "models": models, "gptj_sites": sites, "decode_bandwidth": binaries.gptj_decode_bandwidth(),
      "binaries": compiled, "kept_binaries": binaries.kept_binaries()})


if __name__ == "__main__":
  cli.run(main, one_process="lowers programs for one device")
