"""What this CPU can show of the GPU path: lowering for cuda, rocm and tpu, and GPU binaries.

  python benchmarks/gpu_lowering.py --out results/benchmarks/gpu_lowering.json

1. The kernel at every map shape of the paper's models (`lowering.PAPER_MODELS`), bf16
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
"""

import logging

import jax
from absl import flags

from gsi_jax import cli, experiment, lowering
from gsi_jax.errors import GSIError
from gsi_jax.models import ModelConfig
from gsi_jax.ops import tiling

_OUT = flags.DEFINE_string("out", "results/benchmarks/gpu_lowering.json", "JSON output.")


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
  out = experiment.check_output_path(_OUT.value)
  try:
    import triton
  except ImportError:
    raise GSIError("triton is not installed; pip install -e '.[test]' brings the pinned "
                   "version") from None
  maps = lowering.paper_maps()
  records = []
  for platform in tiling.PLATFORMS:
    for d, d_out, transposed in maps:
      for tokens in lowering.LOWERING_TOKENS:
        for dtype in lowering.LOWERING_DTYPES:
          records.append(lowering.lower_map(platform, tokens, d, d_out, dtype, transposed))
    logging.info("%s: %d map cases lowered", platform, len(maps) * 8)
  default = ModelConfig.smollm2_135m()
  models = [lowering.lower_model(default, platform, impl, head_k)
            for platform in ("cuda", "rocm", "tpu")
            for impl, head_k in (("pallas", 0), ("pallas", 256), ("auto", 0))]
  for m in models:
    logging.info("%s %s head=%s: %d gated maps, %d / %d kernel calls (forward / decode step)",
                 m["platform"], m["impl"], m["gated_head"], m["gated_maps"],
                 m["forward_kernel_calls"], m["decode_step_kernel_calls"])
  sites = [r for platform in lowering.ARCHES for tokens in (1, 16)
           for r in lowering.gptj_site_launches(platform, tokens)]
  for r in sites:
    logging.info("GPT-J %s, %s, %d tokens: %d launches, other ops %s", r["site"],
                 r["platform"], r["tokens"], r["launches"], r["other_ops"] or "none")
  show = lambda r: logging.info(
      "%s %s %s %s T=%d d=%d O=%s: %d registers, %d B spilled, %d B shared, grid %s",
      r["platform"], r["arch"], r["regime"], r["dtype"], r["tokens"], r["d"], r["out"],
      r["registers"], r["spill_bytes"], r["shared_bytes"], r["grid"])
  binaries = lowering.plan_binaries(progress=show)
  experiment.write_json(out, {
      "jax_version": jax.__version__, "triton_version": triton.__version__,
      "what": "lowered and compiled on a CPU, not run",
      "maps": {"models": [c.name for c in lowering.PAPER_MODELS], "shapes": len(maps),
               "tokens": list(lowering.LOWERING_TOKENS),
               "dtypes": list(lowering.LOWERING_DTYPES), "by_platform": map_summary(records)},
      "models": models, "gptj_sites": sites, "decode_bandwidth": lowering.gptj_decode_bandwidth(),
      "binaries": binaries, "kept_binaries": lowering.kept_binaries()})


if __name__ == "__main__":
  cli.run(main, one_process="lowers programs for one device")
