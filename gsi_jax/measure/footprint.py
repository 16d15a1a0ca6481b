"""What each device holds while loading and calibrating a published shape, from its
parameter shapes alone, and what one process holds once a measured run supplies the rest.

A device holds the leaves that `sharding.partition_specs` replicates, its column share of
the split ones, its row share of one layer's float32 Gram matrices (streaming
calibration solves a layer and drops it) and the replicated bf16 calibration windows.
A process also holds its runtime and the transients of loading and solving; those are
one constant per phase, fitted on a one-process run of `benchmarks/scale.py` and then
checked against the runs it was not fitted on.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from gsi_jax.runtime import sharding
from gsi_jax.errors import GSIError
from gsi_jax.loading import synthetic
from gsi_jax.loading.hf_config import config_from_hf
from gsi_jax.loading.load import param_shapes
from gsi_jax.models import params as P

GB = 1e9
PHASES = ("load", "calibration")


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
  """GB one device holds in each phase, on a mesh of `devices`."""
  shape: str
  layers: int
  devices: int
  replicated_gb: float
  split_gb: float  # this device's share
  gram_layer_gb: float  # this device's rows of the largest layer's Gram matrices
  hidden_gb: float

  @property
  def load_gb(self) -> float:
    return self.replicated_gb + self.split_gb

  @property
  def calibration_gb(self) -> float:
    return self.load_gb + self.gram_layer_gb + self.hidden_gb

  def phase_gb(self, phase: str) -> float:
    return self.load_gb if phase == "load" else self.calibration_gb


def shape_config(shape: str, layers: int | None = None):
  if shape not in synthetic.SHAPES:
    raise GSIError(f"unknown shape {shape!r}; use one of {', '.join(synthetic.SHAPES)}")
  config = config_from_hf(synthetic.hf_config(shape).to_dict(), name=shape)
  return dataclasses.replace(config, n_layers=layers) if layers else config


@functools.lru_cache(maxsize=None)
def _bf16_shapes(shape: str, layers: int | None):
  """The decoder's parameter tree (traced once per shape: 96 layers take seconds)."""
  config = shape_config(shape, layers)
  return config, param_shapes(config, jnp.bfloat16)


def device_bytes(shape: str, devices: int, calib_tokens: int,
                 layers: int | None = None) -> DeviceBytes:
  config, shapes = _bf16_shapes(shape, layers)
  specs = jax.tree.leaves(sharding.partition_specs(shapes, devices),
                          is_leaf=lambda x: isinstance(x, PartitionSpec))
  leaves = jax.tree.leaves(shapes)
  replicated = sum(x.size * 2 for x, s in zip(leaves, specs) if s == PartitionSpec())
  split = sum(x.size * 2 for x, s in zip(leaves, specs) if s != PartitionSpec())
  # A Gram matrix whose width the mesh does not divide stays whole (calibration._row_sharded).
  gram = max(sum(4 * d * d / (devices if d % devices == 0 else 1) for d in sites.values())
             for sites in P.site_widths(shapes).values())
  return DeviceBytes(shape, config.n_layers, devices, replicated / GB, split / devices / GB,
                     gram / GB, calib_tokens * config.d_model * 2 / GB)


def gram_all_layers_gb(shape: str) -> float:
  """Float32 Gram matrices of every layer at once: what an all-at-once calibration held."""
  widths = P.site_widths(_bf16_shapes(shape, None)[1])
  return sum(4 * d * d for sites in widths.values() for d in sites.values()) / GB


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
  """The peaks of one `benchmarks/scale.py` JSON: its worst process, per phase."""
  path: str
  shape: str
  layers: int
  processes: int
  calib_tokens: int
  peak_gb: dict  # phase -> GB ("calibration:<method>" for each streaming method)

  @classmethod
  def from_record(cls, path: str, record: dict) -> "MeasuredRun":
    try:
      # Records written before scale.py ran on several processes were one process.
      processes = int(record.get("processes", 1))
      peaks = {"load": max(record.get("load_peak_rss_gb_per_process",
                                      [record["load_peak_rss_gb"]]))}
      per_process = record.get("calib_peak_rss_gb_per_process", {})
      for method, gb in record["calib_peak_rss_gb"].items():
        if method != "eigh":  # the eigh reference holds float64 host copies; not streaming
          peaks[f"calibration:{method}"] = max(per_process.get(method, [gb]))
      return cls(path, record["shape"], int(record["layers"]), processes,
                 int(record["calib_tokens"]), peaks)
    except (KeyError, TypeError, ValueError) as e:
      raise GSIError(f"{path}: not a benchmarks/scale.py record ({e!r} missing or malformed); "
                     "pass a JSON that scale.py wrote") from None

  def modelled(self) -> DeviceBytes:
    # One device per process, as scale.py runs on CPU.
    return device_bytes(self.shape, self.processes, self.calib_tokens, self.layers)


def fit_constants(run: MeasuredRun) -> dict:
  """Per-process GB beyond the modelled bytes, per phase, from a one-process run."""
  if run.processes != 1:
    raise GSIError(f"{run.path}: the constants are fitted on a one-process run, this one had "
                   f"{run.processes}; pass a scale.py JSON with processes 1")
  bytes_ = run.modelled()
  return {phase: gb - bytes_.phase_gb(phase.split(":")[0]) for phase, gb in run.peak_gb.items()}


def check(run: MeasuredRun, constants: dict) -> list[dict]:
  """The fitted model's prediction of each of `run`'s phases against its measured peak."""
  bytes_ = run.modelled()
  rows = []
  for phase, measured in run.peak_gb.items():
    if phase not in constants:
      continue
    predicted = constants[phase] + bytes_.phase_gb(phase.split(":")[0])
    rows.append({"run": run.path, "shape": run.shape, "layers": run.layers,
                 "processes": run.processes, "phase": phase, "measured_gb": measured,
                 "predicted_gb": predicted, "relative_error": predicted / measured - 1})
  return rows
