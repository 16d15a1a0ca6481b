"""Paper scale on one machine: load, calibrate and decode a 6B-shaped random checkpoint.

  python benchmarks/scale.py --shape gptj-6b --checkpoint /data/gptj-6b-random \
      --out results/benchmarks/scale-gptj-6b.json

Weights are random (benchmarks/make_checkpoint.py writes them when --checkpoint
is missing, or --in_memory generates them on the device with nothing on disk): memory,
time and bytes are what this measures, never quality.
Token ids are random too.  Phases, each in this one process:
  load       bf16 weights through load_model, peak resident memory of the load;
  calibrate  streaming calibration at full depth for each --method except eigh, with
             where its time went (calibration_phase_s: embed, forward, gram, solve,
             to_host, save, and JAX's lowering and compiling apart) and the programs
             it compiled (in all, and after its first layer);
  eigh       exact float32 eigh on the first --eigh_layers layers only (at
             16384 wide it takes minutes per matrix here); its full-depth cost
             is modelled as measured per layer x layers, and it is the reference
             for every other method's captured-energy loss on those layers;
  decode     float32 weights cut to --decode_layers blocks at the model's layer
             shape: dense, GSI static (eps = inf) and gated GSI, cache-cold
             by construction (gigabytes of weights per token), against the byte
             ideal of the same parameters and measured fast shares; where the
             decode model is the calibrated one (same depth and dtype), it and
             its first method's bases are reused, not loaded and calibrated again.

On several processes (--coordinator_address, --num_processes, --process_id) every
phase runs on one mesh over all of them, each process reading its columns of the
weights: the Gram matrices of the eigh layers are gathered whole on each process,
which solves them as one process would, and decode steps are tensor-parallel across
the processes, so their tokens/s are those of the mesh, not of one process.  Every
process's peak resident memory is reported (`per_process`).
"""

import dataclasses
import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import gsi_jax
from gsi_jax import cli, experiment, metrics
from gsi_jax.runtime import distributed, sharding
from gsi_jax.measure.benchmarking import PeakMemory, decode_beside, decode_tokens_per_s, ratio_text
from gsi_jax.errors import GSIError
from gsi_jax.gsi import solvers
from gsi_jax.gsi.calibration import METHODS, gram_matrices
from gsi_jax.gsi.checkpoint import check_writable
from gsi_jax.loading import synthetic
from gsi_jax.loading.hf_config import config_from_hf
from gsi_jax.loading.load import first_blocks, param_shapes
from gsi_jax.metrics.analysis import residual_ratios
from gsi_jax.models import params as P

_SHAPE = flags.DEFINE_enum("shape", "gptj-6b", list(synthetic.SHAPES), "Published shape.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Random-weight checkpoint folder "
                                  "(written there first when missing).")
_IN_MEMORY = flags.DEFINE_bool("in_memory", False, "Generate the random weights on the device "
                               "instead of a checkpoint (nothing on disk; load_s is the "
                               "generation time, and bytes_read is 0).")
_LAYERS = flags.DEFINE_integer("layers", None, "Blocks to load and calibrate (default: all).")
_CALIB_TOKENS = flags.DEFINE_integer("calib_tokens", 512, "Calibration tokens (random ids).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Calibration window length.")
_K = flags.DEFINE_integer("k", 64, "Basis size calibrated at full depth.")
_METHODS = flags.DEFINE_list("method", list(METHODS), "Calibration methods to compare.")
_EIGH_LAYERS = flags.DEFINE_integer("eigh_layers", 1, "Layers where eigh is measured (0: no "
                                    "eigh reference, so no energy loss).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Calibration weights.")
_DECODE_LAYERS = flags.DEFINE_integer("decode_layers", 4, "Blocks of the decode model "
                                      "(float32; 0 skips decode).")
_DECODE_DTYPE = flags.DEFINE_enum("decode_dtype", "float32", ["float32", "bfloat16"],
                                  "Decode weights (XLA's CPU bf16 matvec is slow: float32).")
_PEAK_GB_S = flags.DEFINE_float("peak_bandwidth_gb_s", 0.0, "The device's read bandwidth; when "
                                "given, each decode reports its share of it.")
_DECODE_K = flags.DEFINE_integer("decode_k", 256, "k of the decode model's GSI.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 16, "Tokens per timed decode.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed decodes: dense's median, and each point's "
                                "paired rounds beside dense.")
_IMPL = flags.DEFINE_enum("impl", "auto", ["xla", "pallas", "auto"], "GSI's gated map "
                          "(auto: the kernel on a GPU, XLA on cpu).")
_OUT = flags.DEFINE_string("out", None, "JSON output (default results/benchmarks/scale-SHAPE.json).")


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
  shape: str
  checkpoint: str
  layers: int | None
  calib_tokens: int
  seq_len: int
  k: int
  methods: tuple[str, ...]
  eigh_layers: int
  dtype: str
  decode_layers: int
  decode_dtype: str
  peak_bandwidth_gb_s: float
  decode_k: int
  new_tokens: int
  repeats: int
  impl: str
  out: str
  in_memory: bool = False

  def __post_init__(self):
    for name in ("calib_tokens", "seq_len", "k", "decode_k", "new_tokens", "repeats"):
      experiment.positive(f"--{name}", getattr(self, name))
    if self.layers is not None:
      experiment.positive("--layers", self.layers)
    experiment.finite("--peak_bandwidth_gb_s (0: unknown)", self.peak_bandwidth_gb_s, 0, 10**6)
    for name in ("decode_layers", "eigh_layers"):
      if getattr(self, name) < 0:
        raise GSIError(f"--{name} must be >= 0, got {getattr(self, name)}")
    if "eigh" in self.methods and not self.eigh_layers:
      raise GSIError("--method eigh is measured on --eigh_layers layers: give at least 1")
    unknown = [m for m in self.methods if m not in METHODS]
    if unknown or not self.methods:
      raise GSIError(f"--method takes a list of {', '.join(METHODS)}, got {list(self.methods)}")
    if self.calib_tokens < self.seq_len:
      raise GSIError(f"--calib_tokens ({self.calib_tokens}) must hold one --seq_len window "
                     f"({self.seq_len})")
    if self.decode_layers and self.decode_k >= self.calib_tokens:
      raise GSIError(f"--decode_k ({self.decode_k}) must be below --calib_tokens "
                     f"({self.calib_tokens}): the calibration tokens span at most that many "
                     "directions, and a larger basis is arbitrary past them")
    if self.in_memory:
      if self.checkpoint:
        raise GSIError("--checkpoint and --in_memory exclude each other: drop one")
      return
    if not self.checkpoint:
      raise GSIError("--checkpoint is required: a folder holding (or to receive) the "
                     "random-weight checkpoint (or pass --in_memory)")
    if os.path.exists(os.path.join(self.checkpoint, "config.json")):
      if not synthetic.is_complete(self.checkpoint):
        raise GSIError(f"{self.checkpoint} holds an incomplete checkpoint; delete it")
    else:
      check_writable(self.checkpoint)


def check_depth(cfg: ScaleConfig) -> int:
  """The checkpoint's depth (or the shape's, before it is written); checks the layer flags
  and the ranks against the widest site, before any compute."""
  if not cfg.in_memory and synthetic.is_complete(cfg.checkpoint):
    with open(os.path.join(cfg.checkpoint, "config.json"), encoding="utf-8") as f:
      model_config = config_from_hf(json.load(f))
  else:
    model_config = config_from_hf(synthetic.hf_config(cfg.shape).to_dict())
  depth = model_config.n_layers
  widest = P.widest_site(param_shapes(model_config, jnp.float32))
  for flag, k in (("--k", cfg.k), ("--decode_k", cfg.decode_k if cfg.decode_layers else 0)):
    if k > widest:
      raise GSIError(f"{flag}={k} exceeds the widest site of {cfg.shape} ({widest}); lower it")
  layers = cfg.layers or depth
  for flag, value, most in (("--layers", layers, depth), ("--eigh_layers", cfg.eigh_layers, layers),
                            ("--decode_layers", cfg.decode_layers, depth)):
    if value > most:
      raise GSIError(f"{flag}={value} exceeds the {most} layers available; lower it")
  return depth


def _by_width(values: dict, widths: dict, scale: float = 1.0) -> dict:
  """{site width: scale x total of values["layer/site"]} (solve seconds by width)."""
  out: dict = {}
  for key, v in values.items():
    out[widths[key]] = out.get(widths[key], 0.0) + v * scale
  return {str(d): v for d, v in sorted(out.items())}


def calibrate_all(cfg: ScaleConfig, model, ids, mesh=None,
                  save_progress=lambda progress: None) -> tuple[dict, dict]:
  """Streaming calibration per method at full depth, and exact eigh on the first layers:
  the result's fields, and the bases by streamed method.  save_progress({method: layers
  done, of how many, seconds so far, phase seconds}) runs after every layer, so a run cut
  short keeps how far each calibration got."""
  result = {"calibration_s": {}, "solve_s": {}, "calib_peak_rss_gb": {}, "solve_s_by_width": {},
            "lobpcg_iterations": {}, "energy_loss_vs_eigh": {}, "energy_loss_by_site": {},
            "calibration_basis": {}, "calibration_phase_s": {}, "programs_compiled": {},
            "calibration_layer_s": {}}
  bases_by_method = {}
  forward_s = []
  progress = {}
  for method in cfg.methods:
    if method == "eigh":
      continue
    with PeakMemory() as mem:
      t0 = time.perf_counter()

      def on_layer(done, layers, phase_s, method=method, t0=t0):
        cumulative = result["calibration_layer_s"].setdefault(method, [])
        cumulative.append(time.perf_counter() - t0)
        progress[method] = {"layers_done": done, "layers": layers, "phase_s": phase_s,
                            "cumulative_layer_s": cumulative}
        save_progress(progress)
      bases = gsi_jax.calibrate(model, model.params, ids, cfg.k, method=method,
                                seq_len=cfg.seq_len, source="random token ids", mesh=mesh,
                                on_layer=on_layer)
      seconds = time.perf_counter() - t0
    bases_by_method[method] = bases
    solve = {s: c[0] for s, c in bases.meta["solve_cost_by_site"].items()}
    result["calibration_s"][method] = seconds
    result["solve_s"][method] = sum(solve.values())
    widths = {f"{layer}/{site}": bases.vectors[layer][site].shape[0]
              for layer, site in bases.sites()}
    result["solve_s_by_width"][method] = _by_width(solve, widths)
    result["calib_peak_rss_gb"][method] = mem.gb
    result.setdefault("calib_peak_rss_gb_per_process", {})[method] = every_process(mem.gb)
    result["lobpcg_iterations"][method] = {
        key: it for key, (solver, it) in bases.meta["solver_by_site"].items()
        if solver == "lobpcg"}
    result["calibration_basis"][method] = "measured at full depth"
    result["calibration_phase_s"][method] = bases.meta["phase_seconds"]
    result["programs_compiled"][method] = {
        "in_all": bases.meta["programs_compiled"],
        "after_first_layer": bases.meta["programs_compiled_after_first_layer"]}
    forward_s.append(seconds - result["solve_s"][method])
    logging.info("%s: %.1f s (solve %.1f s), peak %.2f GB; phases %s; %d programs compiled, "
                 "%d after the first layer", method, seconds, result["solve_s"][method], mem.gb,
                 ", ".join(f"{k} {v:.1f} s" for k, v in bases.meta["phase_seconds"].items()),
                 bases.meta["programs_compiled"],
                 bases.meta["programs_compiled_after_first_layer"])
  if not cfg.eigh_layers:
    return result, bases_by_method
  # eigh: the reference, measured on the first layers (same inputs as the streaming runs).
  head = first_blocks(model, cfg.eigh_layers)
  with PeakMemory() as mem:
    grams = gram_matrices(head, head.params, np.asarray(ids), progress=False)
    eigh_s, reference = {}, {}
    for layer in P.layers(grams):
      for site, G in grams[layer].items():
        t0 = time.perf_counter()
        w, _ = solvers.top_eigenpairs_float32(jnp.asarray(G), cfg.k)
        eigh_s[f"{layer}/{site}"] = time.perf_counter() - t0
        reference[f"{layer}/{site}"] = (G, w)
        logging.info("eigh %s/%s (%d wide): %.1f s", layer, site, G.shape[0],
                     eigh_s[f"{layer}/{site}"])
  per_layer = sum(eigh_s.values()) / cfg.eigh_layers
  n_layers = model.config.n_layers
  if "eigh" in cfg.methods:
    forward = float(np.mean(forward_s)) if forward_s else math.nan
    result["calibration_s"]["eigh"] = forward + per_layer * n_layers
    result["solve_s"]["eigh"] = per_layer * n_layers
    result["calib_peak_rss_gb"]["eigh"] = mem.gb
    result["calibration_basis"]["eigh"] = (
        f"modelled: solve measured on {cfg.eigh_layers} layer(s) x {n_layers} layers, "
        "plus the streaming runs' mean forward time")
    result["solve_s_by_width"]["eigh"] = _by_width(
        eigh_s, {key: G.shape[0] for key, (G, _) in reference.items()},
        n_layers / cfg.eigh_layers)
  result["eigh_measured_s_by_site"] = eigh_s
  for method, bases in bases_by_method.items():
    losses = {key: solvers.energy_loss(G, bases.vectors[key.split("/")[0]][key.split("/")[1]],
                                       w[:cfg.k])
              for key, (G, w) in reference.items()}
    result["energy_loss_by_site"][method] = losses
    result["energy_loss_vs_eigh"][method] = max(losses.values())
  return result, bases_by_method


def decode_at_layer_shape(cfg: ScaleConfig, ids, mesh=None, save=lambda out: None,
                          calibrated=None) -> dict:
  """Dense, static and gated decode of the model cut to --decode_layers blocks; save(out)
  after dense and after each point.  calibrated: (model, bases, method) of the full-depth
  calibration when it is this very model (same depth and dtype, k >= decode_k), reused
  instead of loading and calibrating again (krylov)."""
  if calibrated is None:
    model = load(cfg, cfg.decode_dtype, cfg.decode_layers, mesh)
    bases = gsi_jax.calibrate(model, model.params, ids, cfg.decode_k, method="krylov",
                              seq_len=cfg.seq_len, source="random token ids", progress=False,
                              mesh=mesh)
    bases_from = "krylov at the decode depth"
  else:
    model, bases, method = calibrated
    bases_from = f"{method} at full depth (reused)"
  params = gsi_jax.apply_gsi(model.params, bases, cfg.decode_k)
  if mesh is not None:
    params = sharding.shard_params(params, mesh)
  # The gated point's eps and the prompt come from ids the bases never saw: on calibration
  # tokens rho is in-sample (at k >= their count, ~0, and the gate would never fire).
  held_out = np.random.default_rng(1).integers(0, model.config.vocab_size,
                                               (1, cfg.seq_len)).astype(np.int32)
  prompt = held_out[:, :16]
  rho = residual_ratios(model, model.params, bases, held_out, [cfg.decode_k])
  median_rho = float(np.median(np.concatenate([r[:, 0] for s in rho.values() for r in s.values()])))
  dense_tps, dense_compile = decode_tokens_per_s(model, model.params, prompt, cfg.new_tokens,
                                                 cfg.repeats)
  dense_bytes = metrics.byte_accounting(model.params)["bytes_per_token_dense"]
  share_of_peak = lambda gb_s: gb_s / cfg.peak_bandwidth_gb_s if cfg.peak_bandwidth_gb_s else None
  out = {"decode_layers": cfg.decode_layers, "decode_k": cfg.decode_k,
         "decode_bases": bases_from,
         "decode_dtype": cfg.decode_dtype, "peak_bandwidth_gb_s": cfg.peak_bandwidth_gb_s or None,
         "gated_eps_from": "median rho of held-out random ids",
         "dense_bandwidth_share": share_of_peak(dense_tps * dense_bytes / 1e9),
         "decode_weights_gb": sum(x.nbytes for x in jax.tree.leaves(model.params)) / 1e9,
         "dense_tokens_per_s": dense_tps, "dense_compile_s": dense_compile,
         "dense_bandwidth_gb_s": dense_tps * dense_bytes / 1e9, "points": []}
  save(out)
  for name, eps in (("static", math.inf), ("gated_median_rho", median_rho), ("gated_all_slow", 0.0)):
    gate = gsi_jax.make_gate(eps, impl=cfg.impl, batch1_switch=True)
    timed = decode_beside(model, prompt, cfg.new_tokens, cfg.repeats, params, gate,
                          model.params)
    tps = timed["tokens_per_s"]
    _, stats = model.generate(params, prompt, cfg.new_tokens, gate, return_stats=True,
                              stop_at_eos=False)
    share = stats["fast_share_by_layer"]
    b = metrics.byte_accounting(params, share, stats["rows_by_layer"])
    out["points"].append({
        "name": name, "eps": eps, "impl": gate.impl, **timed,
        "fast_share": metrics.mean_share(share), "byte_ideal_speedup": b["speedup_bytes"],
        "bandwidth_gb_s": tps * b["bytes_per_token"] / 1e9,
        "bandwidth_share": share_of_peak(tps * b["bytes_per_token"] / 1e9)})
    logging.info("decode %s: %.2f tok/s (dense beside it %.2f), %s, byte ideal x%.2f", name,
                 tps, timed["dense_tokens_per_s"],
                 ratio_text(timed["measured_speedup"], timed["speedup_low"],
                            timed["speedup_high"]), b["speedup_bytes"])
    save(out)
  return out


def every_process(value: float) -> list[float]:
  """`value` of each process, in process order (one value for one process)."""
  if jax.process_count() == 1:
    return [value]
  from jax.experimental import multihost_utils
  return [float(v) for v in np.asarray(multihost_utils.process_allgather(np.float32(value)))]


def load(cfg: ScaleConfig, dtype: str, layers: int | None, mesh=None):
  if cfg.in_memory:
    return synthetic.random_model(cfg.shape, dtype, layers)
  return gsi_jax.load_model(cfg.checkpoint, dtype, n_layers=layers, mesh=mesh)


def run(cfg: ScaleConfig, save=lambda result: None) -> dict:
  """Calibration at full depth, then decode; save(result) after each calibrated layer, after
  calibration and after each decode point, so a run stopped by a time limit keeps what it
  measured."""
  made = None
  if not cfg.in_memory and not synthetic.is_complete(cfg.checkpoint) \
      and distributed.is_primary():
    logging.info("writing a random %s checkpoint to %s", cfg.shape, cfg.checkpoint)
    made = synthetic.write_random_checkpoint(synthetic.hf_config(cfg.shape), cfg.checkpoint)
  distributed.from_primary(0)  # the others wait for the checkpoint
  mesh = sharding.make_mesh() if jax.process_count() > 1 else None
  with PeakMemory() as mem:
    t0 = time.perf_counter()
    model = load(cfg, cfg.dtype, cfg.layers, mesh)
    jax.block_until_ready(model.params)
    load_s = time.perf_counter() - t0
  weights_gb = sum(x.nbytes for x in jax.tree.leaves(model.params)) / 1e9
  logging.info("loaded %d layers, %.2f GB in %.0f s (peak %.2f GB)", model.config.n_layers,
               weights_gb, load_s, mem.gb)
  rng = np.random.default_rng(0)
  n = cfg.calib_tokens // cfg.seq_len
  ids = rng.integers(0, model.config.vocab_size, (n, cfg.seq_len)).astype(np.int32)
  head = {"shape": cfg.shape, "layers": model.config.n_layers, "dtype": cfg.dtype,
          "weights_gb": weights_gb, "load_s": load_s}
  calib, bases_by_method = calibrate_all(
      cfg, model, ids, mesh, lambda progress: save({**head, "calibration_progress": progress}))
  result = {"shape": cfg.shape, "layers": model.config.n_layers, "dtype": cfg.dtype,
            "weights_gb": weights_gb, "load_s": load_s, "load_peak_rss_gb": mem.gb,
            "load_peak_over_weights": mem.gb / weights_gb, "calib_tokens": int(ids.size),
            "processes": jax.process_count(),
            "load_peak_rss_gb_per_process": every_process(mem.gb),
            "bytes_read_gb_per_process": every_process(model.bytes_read / 1e9),
            "k": cfg.k, "eigh_layers": cfg.eigh_layers, "checkpoint_written": made,
            "devices": str(jax.devices()), "sites": sorted(
                {f"{site}:{d}" for sites in P.site_widths(model.params).values()
                 for site, d in sites.items()}), **calib}
  save(result)
  calibrated = None
  if (cfg.decode_layers == model.config.n_layers and cfg.decode_dtype == cfg.dtype
      and cfg.decode_k <= cfg.k and bases_by_method):
    method, bases = next(iter(bases_by_method.items()))
    calibrated = (model, bases, method)
  del model, bases_by_method
  if cfg.decode_layers:
    result.update(decode_at_layer_shape(cfg, ids, mesh, calibrated=calibrated,
                                        save=lambda decode: save({**result, **decode})))
  return result


def main(argv):
  del argv
  cfg = ScaleConfig(
      shape=_SHAPE.value, checkpoint=_CHECKPOINT.value, layers=_LAYERS.value,
      calib_tokens=_CALIB_TOKENS.value, seq_len=_SEQ_LEN.value, k=_K.value,
      methods=tuple(_METHODS.value), eigh_layers=_EIGH_LAYERS.value, dtype=_DTYPE.value,
      decode_layers=_DECODE_LAYERS.value, decode_dtype=_DECODE_DTYPE.value,
      peak_bandwidth_gb_s=_PEAK_GB_S.value, decode_k=_DECODE_K.value,
      new_tokens=_NEW_TOKENS.value, repeats=_REPEATS.value, impl=_IMPL.value,
      out=_OUT.value or f"results/benchmarks/scale-{_SHAPE.value}.json",
      in_memory=_IN_MEMORY.value)
  out = experiment.check_output_path(cfg.out)
  if cfg.in_memory and jax.process_count() > 1:
    raise GSIError("--in_memory generates whole weights in one process; on several processes "
                   "give --checkpoint, which each process reads its columns of")
  check_depth(cfg)
  experiment.write_json(out, run(cfg, save=lambda result: experiment.write_json(
      out, result, partial=True)))


if __name__ == "__main__":
  cli.run(main)
