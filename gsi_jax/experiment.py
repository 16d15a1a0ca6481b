"""What every experiment, the demo and the benchmarks share: one frozen config, checked
before any compute, the setup it describes, and a strict-JSON writer.

No flags here: `gsi_jax.cli` builds an ExperimentConfig from absl flags.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile
from typing import Any, Callable, Sequence

import jax

from gsi_jax import progress, text
from gsi_jax.measure import provenance
from gsi_jax.runtime import distributed, sharding
from gsi_jax.errors import GSIError
from gsi_jax.gsi.cache import DEFAULT_BASES_DIR, cached_bases
from gsi_jax.gsi.calibration import METHODS
from gsi_jax.gsi.checkpoint import can_create_in, check_writable, existing_ancestor
from gsi_jax.loading import DEFAULT_MODEL, load_model
from gsi_jax.loading.load import DTYPES
from gsi_jax.models import params as P
from gsi_jax.ops import IMPLS, MODES, check_threshold

DEFAULT_PROMPTS = (
    "The Python interpreter reads a program and",
    "A list comprehension is",
    "Exceptions are raised when",
    "The capital of France is",
)


# An experiment run bare writes here (ignored by git); --commit writes the committed
# results/ that RESULTS.md cites instead, as `make results` does.
RUNS_DIR = "runs"
COMMITTED_DIR = "results"


def run_path(committed: str) -> str:
  """A script's committed output path (results/NAME.json) moved to the run folder."""
  parts = os.path.normpath(committed).split(os.sep)
  if parts[0] != COMMITTED_DIR:
    raise ValueError(f"{committed} is not under {COMMITTED_DIR}/")
  return os.path.join(RUNS_DIR, *parts[1:])


def portable_path(path: str) -> str:
  """A path as a JSON meant to be committed may hold it: relative to the working folder
  when under it, ~/... under the user's home, else as given."""
  if not path or not os.path.isabs(path):
    return path
  here, home = os.getcwd(), os.path.expanduser("~")
  if os.path.commonpath([path, here]) == here:
    return os.path.relpath(path, here)
  if home not in ("", "/") and os.path.commonpath([path, home]) == home:
    return os.path.join("~", os.path.relpath(path, home))
  return path


# Written beside a JSON output: its table, its figure and pareto's allocation figure.
SIBLING_SUFFIXES = (".md", ".png", "_allocation.png")


def check_output_path(path: str, flag: str = "--out") -> str:
  """Fail now, not after the compute: `path` must be a writable .json path whose
  siblings (.md table, .png figure) can be created too and can never equal it.

  Creates its folder, as the write would.
  """
  path = os.path.abspath(path)
  if os.path.isdir(path):
    raise GSIError(f"{flag}: {path} is a folder; give a file path such as {path}/out.json")
  if not path.endswith(".json"):
    raise GSIError(f"{flag}: {path} must end in .json (the table and the figure are "
                   "written beside it as .md and .png)")
  folder = os.path.dirname(path)
  probe = existing_ancestor(folder)
  if not os.path.isdir(probe):
    raise GSIError(f"{flag}: {probe} is a file, so {path} cannot be created under it")
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise GSIError(f"{flag}: cannot create {folder} ({e.strerror})") from None
  if not can_create_in(folder) or (os.path.exists(path) and not os.access(path, os.W_OK)):
    raise GSIError(f"{flag}: {path} is not writable")
  stem = os.path.basename(path)[:-len(".json")]
  longest = max((stem + suffix for suffix in SIBLING_SUFFIXES + (".json",)), key=len)
  if len(longest.encode()) > os.pathconf(folder, "PC_NAME_MAX"):
    raise GSIError(f"{flag}: the file name {os.path.basename(path)!r} is too long for "
                   f"{folder} (its sibling {longest!r} must fit too); shorten it")
  for sibling in (os.path.join(folder, stem + suffix) for suffix in SIBLING_SUFFIXES):
    if os.path.isdir(sibling):
      raise GSIError(f"{flag}: {sibling}, where the table or figure goes, is a folder; "
                     "move it or choose another --out")
  return path


# Fields that name a path of the machine that wrote the JSON: written by `portable_path`.
PATH_FIELDS = frozenset({"out", "bases_dir", "model", "calib_text_file", "eval_text_file",
                         "prompts_file", "checkpoint", "export_dir", "logs", "dir"})


def portable_paths(value):
  """`value` with every PATH_FIELDS string made portable, at any depth."""
  if isinstance(value, dict):
    return {k: portable_path(v) if k in PATH_FIELDS and isinstance(v, str) else
            portable_paths(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [portable_paths(v) for v in value]
  return value


def strict_json(value):
  """inf and nan are not JSON: write them as strings; tuples as lists."""
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  if isinstance(value, dict):
    return {str(k): strict_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [strict_json(v) for v in value]
  return value


def write_text_atomic(path: str, content: str) -> None:
  """Write beside, then rename: an interrupted write never leaves a half file.  In a run
  of several processes, process 0 writes for all of them."""
  if not distributed.is_primary():
    return
  folder = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
  try:
    with os.fdopen(fd, "w") as f:
      f.write(content)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


# The outputs this process has saved partway and not yet completed (an interruption says so).
PARTIAL_WRITES: set[str] = set()


def write_json(path: str, value, *, partial: bool = False) -> str:
  """Strict JSON (no bare Infinity/NaN), written atomically, with no absolute path of this
  machine's in a PATH_FIELDS field.  A result (a dict) gains a `run` field: the machine,
  the versions and the wall time from the process's start.
  partial: a result saved as its rows come in: it says "complete": false (a final write
  without `partial` says nothing of it), logs no line, and an interruption names it."""
  if isinstance(value, dict):
    value = {**({"complete": False} if partial else {}), **value,
             "run": provenance.run_record()}
  write_text_atomic(path, json.dumps(strict_json(portable_paths(value)), indent=2,
                                     allow_nan=False) + "\n")
  (PARTIAL_WRITES.add if partial else PARTIAL_WRITES.discard)(os.path.abspath(path))
  if distributed.is_primary() and not partial:
    logging.info("wrote %s", path)
  return path


def finite(name: str, value, low: float | None = None, high: float | None = None,
           low_open: bool = False) -> float:
  """A number flag: finite (inf and nan refused: a size of inf has no bytes) and within
  [low, high] (or (low, high] with low_open); else one error naming the flag."""
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise GSIError(f"{name} must be a number, got {value!r}") from None
  below = low is not None and (number <= low if low_open else number < low)
  if not math.isfinite(number) or below or (high is not None and number > high):
    bounds = f"{'(' if low_open else '['}{low if low is not None else '-inf'}, " \
             f"{high if high is not None else 'inf'}{']' if high is not None else ')'}"
    raise GSIError(f"{name} must be a finite number in {bounds}, got {value}")
  return number


def whole_numbers(name: str, text: str, sep: str = "x") -> tuple[int, ...]:
  """'4096x16384' as positive whole numbers, ASCII digits only (str.isdigit also takes
  '²', which int() refuses)."""
  parts = text.lower().split(sep)
  if not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
    raise GSIError(f"{name}: {text!r} is not positive whole numbers joined by {sep}")
  return tuple(int(p) for p in parts)


def positive(name: str, value: int) -> int:
  if value is None or int(value) < 1:
    raise GSIError(f"{name} must be a positive whole number, got {value}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Every knob of an experiment; checked on construction, before any compute."""
  model: str = DEFAULT_MODEL
  k: tuple[int, ...] = (128, 256, 384)
  eps: tuple[float, ...] = (0.05, 0.1, 0.2)
  mode: tuple[str, ...] = ("gated",)
  impl: str = "xla"
  dtype: str = "float32"
  calib_text_file: str = text.PYDOC_CALIB
  eval_text_file: str = text.PYDOC_EVAL
  calib_tokens: int = 16384
  eval_tokens: int = 8192
  seq_len: int = 256
  method: str = "eigh"
  bases_dir: str = DEFAULT_BASES_DIR
  prompts: tuple[str, ...] = DEFAULT_PROMPTS
  prompts_file: str | None = None
  max_new_tokens: int = 50
  out: str = ""

  def __post_init__(self):
    if not self.k or any(int(k) < 1 for k in self.k):
      raise GSIError(f"--k values must be positive whole numbers, got {list(self.k)}")
    if not self.eps:
      raise GSIError("--eps is empty")
    if not self.mode:
      raise GSIError(f"--mode is empty; give one or more of {', '.join(MODES)}")
    for name in ("k", "eps", "mode"):
      values = list(getattr(self, name))
      if len(set(values)) != len(values):
        raise GSIError(f"--{name} repeats a value ({','.join(map(str, values))}); give each "
                       "once")
    for e in self.eps:
      check_threshold("--eps values", e)
    for m in self.mode:
      if m not in MODES:
        raise GSIError(f"--mode {m!r} is not one of {', '.join(MODES)}")
    if self.impl not in IMPLS:
      raise GSIError(f"--impl {self.impl!r} is not one of {', '.join(IMPLS)}")
    if self.dtype not in DTYPES:
      raise GSIError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
    if self.method not in METHODS:
      raise GSIError(f"--method {self.method!r} is not one of {', '.join(METHODS)}")
    if self.seq_len < 2:
      raise GSIError(f"--seq_len must be >= 2, got {self.seq_len}")
    for name in ("calib_tokens", "eval_tokens"):
      value = getattr(self, name)
      if value < self.seq_len:
        raise GSIError(f"--{name} must be at least one window (--seq_len={self.seq_len}), "
                       f"got {value}")
    if self.k_max >= self.calib_tokens:
      raise GSIError(f"--k={self.k_max} needs more than {self.k_max} calibration tokens, got "
                     f"--calib_tokens={self.calib_tokens}: every calibration token would lie "
                     "in the span, and directions beyond them are arbitrary")
    positive("--max_new_tokens", self.max_new_tokens)
    text.check_source(self.calib_text_file, "--calib_text_file")
    text.check_source(self.eval_text_file, "--eval_text_file")
    if not self.prompts:
      raise GSIError(f"--prompts_file {self.prompts_file} has no prompts (one per line)")
    if self.bases_dir:
      check_writable(self.bases_dir)
    if self.out:
      check_output_path(self.out)

  @property
  def k_max(self) -> int:
    return max(self.k)

  def flags(self) -> dict:
    """Every setting, for the JSON's "config"."""
    return dataclasses.asdict(self)


def read_prompts(path: str | None) -> tuple[str, ...]:
  """One prompt per non-empty line of `path`; the default prompts without one."""
  if not path:
    return DEFAULT_PROMPTS
  return tuple(line.strip() for line in text.load_text(path, "--prompts_file").splitlines()
               if line.strip())


@dataclasses.dataclass
class Setup:
  config: ExperimentConfig
  model: Any
  calib: text.TokenWindows
  held_out: text.TokenWindows | None
  bases: Any = None
  mesh: Any = None

  def ensure_bases(self):
    """The bases up to max(k), restored or calibrated on first use: a run whose methods
    need none (pareto without GSI) never calibrates."""
    if self.bases is None:
      self.bases = cached_bases(self.model, self.model.params, self.calib, self.config.k_max,
                                self.config.method, self.config.bases_dir or None, self.mesh)
    return self.bases

  def describe(self, **extra) -> dict:
    """The JSON's "config": every setting, the model and both texts."""
    return {**self.config.flags(), "model_name": self.model.config.name,
            "calibration": self.calib.describe(),
            "evaluation": self.held_out.describe() if self.held_out is not None else None,
            **extra}


def prepare(config: ExperimentConfig, bases: bool = True, need_eval: bool = True,
            check_model: Callable[[Any], None] | None = None) -> Setup:
  """Load the model and text; check k (and with check_model, the caller's own flags)
  against the model; calibrate (or restore) bases up to max(k), now or (bases=False) when
  `Setup.ensure_bases` first asks."""
  # Several devices (of one process or of several): one mesh over all of them, each
  # process reading the part of the weights its devices hold.
  mesh = sharding.make_mesh() if jax.device_count() > 1 else None
  with progress.step(f"loading {config.model} ({config.dtype})"):
    model = load_model(config.model, config.dtype, mesh=mesh)
  widest = P.widest_site(model.params)
  if config.k_max > widest:
    raise GSIError(f"--k={config.k_max} exceeds the widest site of {model.config.name} "
                   f"({widest})")
  model.check_length(config.seq_len, "--seq_len")
  if check_model is not None:
    check_model(model)
  calib = text.windows(model, config.calib_text_file, config.seq_len, config.calib_tokens,
                       "--calib_text_file")
  held_out = (text.windows(model, config.eval_text_file, config.seq_len, config.eval_tokens,
                           "--eval_text_file") if need_eval else None)
  for flag, asked, got in (("calib_tokens", config.calib_tokens, calib),
                           ("eval_tokens", config.eval_tokens, held_out)):
    if got is not None and got.n_tokens <= asked - config.seq_len:  # short by a window or more
      raise GSIError(f"--{flag}={asked}, but {got.source} holds only {got.n_tokens} tokens in "
                     f"windows of {config.seq_len}; pass --{flag}={got.n_tokens} or a "
                     "longer text")
  s = Setup(config, model, calib, held_out, mesh=mesh)
  if bases:
    s.ensure_bases()
  return s


def markdown_table(records: list[dict], columns: Sequence[str]) -> str:
  def cell(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in records]
  return "\n".join(lines)


def partial_path(out: str) -> str:
  """Where a run that stopped partway writes what it finished: beside --out, never over it."""
  return os.path.splitext(out)[0] + ".partial.json"


def write_records(out: str, config: dict, records: list[dict], columns: Sequence[str],
                  show: bool = True, stopped: str | None = None) -> str:
  """Write {"config", "records"} JSON and the Markdown table beside it; print the table, or
  with show=False (per-layer rows: the caller prints a summary) say where it is.  stopped:
  why the run ended before its last record; the JSON then says "complete": false."""
  table = markdown_table(records, columns)
  md = os.path.splitext(out)[0] + ".md"
  print(table if show else f"{len(records)} rows: {md}")
  partial = {} if stopped is None else {"complete": False, "stopped": stopped}
  write_json(out, {**partial, "config": config, "records": records})
  write_text_atomic(md, table + "\n")
  return out


def save_figure(fig, json_out: str) -> str:
  """The PNG beside the JSON."""
  path = os.path.splitext(json_out)[0] + ".png"
  fig.tight_layout()
  if distributed.is_primary():
    fig.savefig(path, dpi=120, bbox_inches="tight")  # a legend beside the axes included
    logging.info("wrote %s", path)
  return path
