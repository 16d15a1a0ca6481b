"""What a method is, and the one registry of them.

A method declares its knobs (the flags its grid reads), the points it evaluates (each a
pure rewrite of the base tree, built from the calibration statistics that `Context`
shares across methods), the bytes each point reads per token (from the one byte formula,
`gsi_jax.metrics.bytes`), and which operation serves its fast path on each platform.
`experiments/pareto.py` runs any registered method without knowing it by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping

from gsi_jax.errors import GSIError

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# Flags that `experiments/pareto.py` defines besides the knobs (the shared experiment and
# process flags, its own, and absl's): a knob may take none of these names
# (tests/test_methods.py checks this list against the script's flags).
TAKEN_FLAGS = frozenset({
    "model", "k", "eps", "mode", "impl", "dtype", "calib_text_file", "eval_text_file",
    "calib_tokens", "eval_tokens", "seq_len", "method", "bases_dir", "prompts_file",
    "max_new_tokens", "out", "commit", "coordinator_address", "num_processes", "process_id",
    "distributed_auto", "process_timeout_s", "methods", "speed_repeats", "learned",
    "help", "helpshort", "helpfull", "helpxml", "flagfile", "undefok", "v", "verbosity",
    "logtostderr", "alsologtostderr", "log_dir", "stderrthreshold", "showprefixforinfo",
    "logger_levels", "only_check_args", "pdb", "pdb_post_mortem", "run_with_pdb",
    "run_with_profiling", "profile_file", "use_cprofile_for_profiling"})


@dataclasses.dataclass(frozen=True)
class Knob:
  """One flag of a method's grid: a comma list (`many`) or a single number or name."""
  name: str
  cast: type
  default: Any
  help: str
  check: Callable[[Any], str | None] = lambda value: None  # an error message, or None
  many: bool = True
  may_be_empty: bool = False
  sort: bool = False

  def checked(self, value) -> Any:
    """value (a tuple for a list knob), once its own check passes."""
    message = self.check(value)
    if message:
      raise GSIError(message)
    return value


@dataclasses.dataclass(frozen=True)
class Point:
  """One record of a method: its knob label, the tree it evaluates, its gate (None:
  dense), fields the record adds, whether it keeps its per-layer shares, and knob values
  its bytes need that the tree does not show (svd's rank)."""
  knob: str
  params: Any
  gate: Any = None
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  shares: bool = False
  values: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _always(grid, model_config) -> bool:
  return True


@dataclasses.dataclass(frozen=True)
class Method:
  """A registered method.

  points(ctx) yields its records' Points one at a time (a tree is built, scored and
  dropped before the next); bytes_of(point) -> scores -> weight bytes per token;
  fast_path names the operation that reads fewer bytes at batch 1, per platform.  An
  allocation (learned or searched per site) names the uniform method it is compared with.
  """
  name: str
  doc: str
  knobs: tuple[Knob, ...]
  points: Callable[[Any], Iterable[Point]]
  bytes_of: Callable[[Point], Callable[[dict], float]]
  fast_path: Mapping[str, str]
  uniform: str | None = None
  learned: bool = False  # runs with --learned, beside its uniform method
  runs_on: Callable[[Mapping[str, Any], Any], bool] = _always  # (grid, model config)
  # Checks across knobs, before any compute: (grid, experiment config), raising GSIError.
  check: Callable[[Mapping[str, Any], Any], None] | None = None
  # What the model must have, as (a phrase naming it, model config -> bool): a method named
  # in --methods on a model without it is refused before calibration.
  needs: tuple[str, Callable[[Any], bool]] | None = None

  def no_points(self) -> GSIError:
    """The error for a method asked to run that makes no point with the run's settings."""
    return GSIError(f"method {self.name} makes no point with these settings (its knobs: "
                    f"{', '.join(k.name for k in self.knobs) or 'none'}, and --k); give its "
                    f"knobs values, or drop {self.name} from --methods")


REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
  """Add a method; its name must be new, a knob it shares with another method must be
  the same Knob (one flag, one meaning), and no knob may take a flag a script already has."""
  if method.name in REGISTRY:
    raise GSIError(f"a method named {method.name} is already registered")
  missing = set(PLATFORMS) - set(method.fast_path)
  if missing:
    raise GSIError(f"method {method.name} names no fast path for {sorted(missing)}")
  if method.uniform is not None and method.uniform not in REGISTRY:
    raise GSIError(f"method {method.name}: its uniform method {method.uniform} is not "
                   "registered (register it first)")
  known = knobs()
  for knob in method.knobs:
    if knob.name in TAKEN_FLAGS:
      raise GSIError(f"method {method.name}: knob --{knob.name} would clash with the flag "
                     f"--{knob.name} that experiments/pareto.py already has; rename the knob")
    if knob.name in known and known[knob.name] is not knob:
      raise GSIError(f"method {method.name}: knob --{knob.name} is already declared "
                     "differently by another method")
  REGISTRY[method.name] = method
  return method


def unregister(name: str) -> None:
  """Remove a method (a test's own method, once the test is done)."""
  REGISTRY.pop(name)


def names() -> tuple[str, ...]:
  return tuple(REGISTRY)


def knobs() -> dict[str, Knob]:
  """Every registered knob by flag name."""
  return {k.name: k for m in REGISTRY.values() for k in m.knobs}


def users(knob: str) -> tuple[str, ...]:
  """The methods that read a knob."""
  return tuple(m.name for m in REGISTRY.values() if any(k.name == knob for k in m.knobs))
