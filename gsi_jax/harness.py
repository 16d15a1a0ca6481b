"""What every experiment script shares: flags, setup, and output.

Scripts in experiments/ define no flags of their own beyond these, call
`setup()` for the model, text and bases, and `write()` for their records:
JSON shaped {"config": {...}, "records": [...]} plus a Markdown table.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any, Sequence

from absl import flags

import gsi_jax
from gsi_jax import text
from gsi_jax.errors import GSIError
from gsi_jax.gsi.cache import DEFAULT_BASES_DIR, cached_bases

FLAGS = flags.FLAGS
flags.DEFINE_string("model", gsi_jax.DEFAULT_MODEL, "Preset, .gguf path, HF folder or hub id.")
flags.DEFINE_list("k", ["128", "256", "384"], "Subspace ranks (comma list).")
flags.DEFINE_list("eps", ["0.05", "0.1", "0.2"], "Gate thresholds (comma list; inf allowed).")
flags.DEFINE_list("mode", ["gated"], "Gate modes: gated, static, dense (comma list).")
flags.DEFINE_string("calib_text_file", text.PYDOC_CALIB, "Calibration text (file, pydoc:..., hf:...).")
flags.DEFINE_string("eval_text_file", text.PYDOC_EVAL, "Held-out evaluation text.")
flags.DEFINE_integer("calib_tokens", 16384, "Calibration tokens.")
flags.DEFINE_integer("eval_tokens", 8192, "Evaluation tokens.")
flags.DEFINE_integer("seq_len", 256, "Window length in tokens.")
flags.DEFINE_string("method", "eigh", "Calibration method: eigh or cascade.")
flags.DEFINE_string("bases_dir", DEFAULT_BASES_DIR, "Orbax bases cache ('' to disable).")
flags.DEFINE_string("prompts_file", None, "One prompt per line (generation scripts).")
flags.DEFINE_integer("max_new_tokens", 50, "Tokens generated per prompt.")
flags.DEFINE_string("out", None, "JSON output path.")

DEFAULT_PROMPTS = (
    "The Python interpreter reads a program and",
    "A list comprehension is",
    "Exceptions are raised when",
    "The capital of France is",
)


def _numbers(name: str, values: Sequence[str], cast) -> list:
  try:
    out = [cast(v) for v in values]
  except ValueError:
    raise GSIError(f"--{name} must be a comma list of numbers, got {','.join(values)}") from None
  if not out:
    raise GSIError(f"--{name} is empty")
  return out


def ks() -> list[int]:
  values = _numbers("k", FLAGS.k, int)
  if min(values) <= 0:
    raise GSIError(f"--k values must be positive, got {values}")
  return values


def epsilons() -> list[float]:
  values = _numbers("eps", FLAGS.eps, float)
  if any(math.isnan(v) or v < 0 for v in values):
    raise GSIError(f"--eps values must be >= 0, got {values}")
  return values


def modes() -> list[str]:
  for m in FLAGS.mode:
    if m not in ("gated", "static", "dense"):
      raise GSIError(f"--mode {m!r} is not one of gated, static, dense")
  return list(FLAGS.mode)


def prompts() -> list[str]:
  if not FLAGS.prompts_file:
    return list(DEFAULT_PROMPTS)
  lines = [l.strip() for l in text.load_text(FLAGS.prompts_file).splitlines() if l.strip()]
  if not lines:
    raise GSIError(f"{FLAGS.prompts_file} has no prompts (one per line)")
  return lines


@dataclasses.dataclass
class Setup:
  model: Any
  calib: text.TokenWindows
  held_out: text.TokenWindows
  bases: Any = None


def setup(k_max: int | None = None, need_eval: bool = True) -> Setup:
  """Load the model and text; calibrate (or restore) bases up to k_max."""
  if FLAGS.method not in ("eigh", "cascade"):
    raise GSIError(f"--method {FLAGS.method!r} is not one of eigh, cascade")
  model = gsi_jax.load_model(FLAGS.model)
  calib = text.windows(model, FLAGS.calib_text_file, FLAGS.seq_len, FLAGS.calib_tokens)
  held_out = (text.windows(model, FLAGS.eval_text_file, FLAGS.seq_len, FLAGS.eval_tokens)
              if need_eval else None)
  s = Setup(model, calib, held_out)
  if k_max is not None:
    widest = max(v for v in _widths(model.params))
    s.bases = cached_bases(model, model.params, calib, min(k_max, widest), FLAGS.method,
                           FLAGS.bases_dir or None)
  return s


def _widths(params):
  from gsi_jax.gsi.bases import site_kernels
  return [W.shape[0] for s in site_kernels(params).values() for ks_ in s.values()
          for W in ks_.values()]


def config(s: Setup, **extra) -> dict:
  """Every flag and source, for the JSON's "config"."""
  names = ["model", "k", "eps", "mode", "calib_text_file", "eval_text_file", "calib_tokens",
           "eval_tokens", "seq_len", "method", "bases_dir", "prompts_file", "max_new_tokens"]
  out = {n: FLAGS[n].value for n in names}
  out["model_name"] = s.model.config.name
  out["calibration"] = s.calib.describe()
  out["evaluation"] = s.held_out.describe() if s.held_out is not None else None
  out.update(extra)
  return out


def markdown_table(records: list[dict], columns: Sequence[str]) -> str:
  def cell(v):
    if isinstance(v, float):
      return f"{v:.4g}"
    return str(v)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in records]
  return "\n".join(lines)


def strict_json(value):
  """inf and nan are not JSON: write them as strings."""
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  if isinstance(value, dict):
    return {k: strict_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [strict_json(v) for v in value]
  return value


def write(config_: dict, records: list[dict], columns: Sequence[str],
          default_out: str) -> str:
  """Print the Markdown table; write JSON (and the table beside it as .md)."""
  table = markdown_table(records, columns)
  print(table)
  out = output_path(default_out)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    json.dump(strict_json({"config": config_, "records": records}), f, indent=2)
  with open(os.path.splitext(out)[0] + ".md", "w") as f:
    f.write(table + "\n")
  logging.info("wrote %s", out)
  return out


def figure_path(json_out: str) -> str:
  return os.path.splitext(json_out)[0] + ".png"


def save_figure(fig, json_out: str) -> None:
  path = figure_path(json_out)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  logging.info("wrote %s", path)


def output_path(default_out: str) -> str:
  return FLAGS.out or default_out
