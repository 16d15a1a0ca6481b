"""Calibration: each site's Gram matrix X^T X, then its top subspace.

`calibrate` streams layer by layer, as GPTQ does: the calibration windows'
hidden states are carried from one layer to the next, only one layer's Gram
matrices are alive at a time, and with `resume_dir` each finished layer is
saved so that an interrupted calibration resumes where it stopped.
`gram_matrices` + `solve` is the all-at-once form (one forward of the whole
model), kept for the LM head's input and as the streaming form's reference.

Where the time goes is recorded with the bases (meta "phase_seconds": embedding, forward,
Gram accumulation, solve, host transfers, saving, and JAX's lowering and compiling apart
from all of them; "programs_compiled", and how many of those came after the first layer).
The sites LOBPCG serves are solved on the device under a transfer guard and reach the host
in one copy per layer.
"""

from __future__ import annotations

import contextlib
import functools
import math
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gsi_jax.runtime import distributed, sharding
from gsi_jax.measure.benchmarking import CompileEvents
from gsi_jax import progress as progress_lines
from gsi_jax.errors import GSIError, flag, whole
from gsi_jax.gsi import cascade, solvers
from gsi_jax.gsi.bases import FORMAT_VERSION, Bases, calibration_identity
from gsi_jax.gsi.checkpoint import LayerProgress, check_layer, exclusive
from gsi_jax.models import params as P
from gsi_jax.models.decoder import Block, Decoder
from gsi_jax.models.model import check_model

METHODS = ("eigh", "cascade", "krylov")


GRAM_BLOCK_ROWS = 2048


def _add_gram(gram, x, row0=0):
  """gram + XᵀX, updated in place a block of rows at a time in a loop: `gram + X.T @ X`
  (or a slice-by-slice .at[].add) makes XLA hold a second d × d matrix (1 GiB at d = 16384).

  gram may be rows row0.. of the whole Gram matrix (one device's share of it)."""
  X = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  rows = gram.shape[0]
  if rows <= GRAM_BLOCK_ROWS:
    return gram + jax.lax.dynamic_slice_in_dim(X, row0, rows, axis=1).T @ X
  block = math.gcd(rows, GRAM_BLOCK_ROWS)  # divides rows, so every step is a full block

  def add_rows(i, gram):
    cols = jax.lax.dynamic_slice_in_dim(X, row0 + i * block, block, axis=1)
    updated = jax.lax.dynamic_slice_in_dim(gram, i * block, block, axis=0) + cols.T @ X
    return jax.lax.dynamic_update_slice_in_dim(gram, updated, i * block, axis=0)
  return jax.lax.fori_loop(0, rows // block, add_rows, gram)


@functools.partial(jax.jit, static_argnames=("module", "collection"), donate_argnums=(1,))
def _accumulate(module, grams, params, ids_BT, collection):
  _, state = module.apply({"params": params}, ids_BT, mutable=[collection])
  return jax.tree.map(_add_gram, grams, P.unwrap_sown(state[collection]))


def gram_matrices(model, params, windows_NT: np.ndarray, batch_size: int = 4,
                  progress: bool = True, collection: str = P.SITE_INPUTS) -> dict:
  """X^T X of every sown input over all windows at once (float32 numpy).

  collection "site_inputs": {layer: {site: G}}; "head_inputs": {"lm_head": G}.
  """
  _, state = jax.eval_shape(
      lambda p, x: model.module.apply({"params": p}, x, mutable=[collection]),
      params, jnp.zeros((1, windows_NT.shape[1]), jnp.int32))
  grams = jax.tree.map(lambda x: jnp.zeros((x.shape[-1],) * 2, jnp.float32),
                       P.unwrap_sown(state[collection]))
  n = windows_NT.shape[0]
  start = time.time()
  for i in range(0, n, batch_size):
    grams = _accumulate(model.module, grams, params, jnp.asarray(windows_NT[i:i + batch_size]),
                        collection)
    if progress:
      jax.block_until_ready(grams)  # dispatch is asynchronous: report work actually done
      done = min(i + batch_size, n)
      progress_lines.say("calibration forward: %d/%d windows (%.0f s)", done, n,
                         time.time() - start)
  return jax.tree.map(distributed.host_copy, grams)  # whole, also when processes share it


def on_device(d: int, k_max: int, method: str) -> bool:
  """Whether a site of width d is solved on the device (LOBPCG), not on the host."""
  return method != "eigh" and solvers.lobpcg_fits(d, min(k_max, d))


def solve_site(G, k_max: int, method: str, previous):
  """(w, V, cost) for one Gram matrix; cost = {seconds, flops, solver, iterations}.

  eigh: exact, float64 on the host.  krylov: LOBPCG from a random block.
  cascade: LOBPCG (or, where 5k >= d, block Davidson) from the previous
  layer's basis `previous`; a first layer has none and starts as krylov does.
  LOBPCG runs on the device (`on_device`), where `solve_layer` keeps its results.
  """
  d = G.shape[0]
  k = min(k_max, d)  # a site narrower than k_max keeps its full basis
  t0 = time.perf_counter()
  if on_device(d, k_max, method):
    w, V, iterations = (distributed.host_copy(a) for a in _solve_on_device(G, k, method,
                                                                           previous))
    return w.astype(np.float64), V.astype(np.float64), _lobpcg_cost(
        time.perf_counter() - t0, d, k, int(iterations))
  G64 = distributed.host_copy(G).astype(np.float64)
  # float32 accumulation leaves X^T X slightly asymmetric; eigh reads one triangle only.
  G64 = (G64 + G64.T) / 2
  if method == "cascade" and previous is not None:
    w, V, flops = cascade.refine(G64, np.asarray(previous))
    solver = "block_davidson"
  else:
    w, V = solvers.top_eigenpairs(G64, k)
    solver, flops = "eigh", cascade.eigh_flops(d)
  cost = {"seconds": time.perf_counter() - t0, "flops": float(flops), "solver": solver,
          "iterations": 0}
  return w, V, cost


def _solve_on_device(G, k: int, method: str, previous):
  """LOBPCG's (w, V, iterations) on the device; a cascade starts from `previous`."""
  # LOBPCG only multiplies by G: no symmetrised copy (a whole extra Gram at d = 16384).
  warm = method == "cascade" and previous is not None
  start = previous if warm else solvers.random_start(G.shape[0], k)
  return solvers.lobpcg_on_device(G, start)


def _lobpcg_cost(seconds: float, d: int, k: int, iterations: int) -> dict:
  return {"seconds": seconds, "flops": float(solvers.lobpcg_flops(d, k, iterations)),
          "solver": "lobpcg", "iterations": iterations}


@jax.jit
def _trace(G_DD):
  # Eager jnp.trace materialises a d × d temporary (1 GiB at d = 16384); this reads the diagonal.
  return jnp.sum(jnp.diagonal(G_DD).astype(jnp.float32))


def solve_layer(grams_layer: dict, k_max: int, method: str, previous: dict,
                seconds: dict | None = None):
  """Solve every site of one layer; updates `previous` (site -> basis, kept where its
  solver runs: on the device for LOBPCG) for the cascade.

  The device's sites first, with no host transfer either way (transfer guards: a warm
  start read from the host, or a result copied out, would raise; each site is waited for, so
  its seconds are its own), then all their results come to the host in one copy, then
  the host's sites are solved.  `seconds` gains "to_host"."""
  seconds = {} if seconds is None else seconds
  device = [site for site, G in grams_layer.items() if on_device(G.shape[0], k_max, method)]
  on_host = lambda a: not isinstance(a, jax.Array)
  for site in device:  # `solve`'s Grams, and a resumed run's last bases, are on the host
    if on_host(grams_layer[site]):
      grams_layer = {**grams_layer, site: jnp.asarray(grams_layer[site])}
    if site in previous and on_host(previous[site]):
      previous[site] = jnp.asarray(previous[site], jnp.float32)
  solved, elapsed = {}, {}
  with jax.transfer_guard_host_to_device("disallow"), \
      jax.transfer_guard_device_to_host("disallow"):  # between devices is device work
    for site in device:
      G, start = grams_layer[site], time.perf_counter()
      k = min(k_max, G.shape[0])
      solved[site] = jax.block_until_ready(
          (*_solve_on_device(G, k, method, previous.get(site)), _trace(G)))
      elapsed[site] = time.perf_counter() - start
  t1 = time.perf_counter()
  fetched = jax.tree.map(distributed.host_copy, solved)  # the layer's one copy to the host
  t2 = time.perf_counter()
  vectors, eigenvalues, trace, costs = {}, {}, {}, {}
  for site, G in grams_layer.items():
    if site in solved:
      w, V, iterations, site_trace = fetched[site]
      previous[site] = solved[site][1]  # float32 as saved: a resumed cascade starts alike
      costs[site] = _lobpcg_cost(elapsed[site], G.shape[0], V.shape[1], int(iterations))
    else:
      w, V, costs[site] = solve_site(G, k_max, method, previous.get(site))
      previous[site] = np.asarray(V, np.float32)
      site_trace = distributed.host_copy(_trace(G))
    vectors[site] = np.asarray(V, np.float32)
    eigenvalues[site], trace[site] = np.asarray(w, np.float32), np.float32(site_trace)
  seconds["to_host"] = seconds.get("to_host", 0.0) + (t2 - t1)
  return vectors, eigenvalues, trace, costs


def _check_method(method: str, k_max: int) -> None:
  if method not in METHODS:
    raise GSIError(f"calibration method {method!r} is not one of {METHODS}")
  if k_max <= 0:
    raise GSIError(f"k_max must be positive, got {k_max}")


def _bases(vectors, eigenvalues, trace, costs, method, k_max) -> Bases:
  per_site = {f"{layer}/{site}": [c["seconds"], c["flops"]]
              for layer, sites in costs.items() for site, c in sites.items()}
  meta = {
      "format_version": FORMAT_VERSION, "method": method, "k_max": int(k_max),
      "solve_seconds": sum(c[0] for c in per_site.values()),
      "solve_flops": sum(c[1] for c in per_site.values()),
      "solve_cost_by_site": per_site,  # "layer/site": [seconds, flops]
      "solver_by_site": {f"{layer}/{site}": [c["solver"], c["iterations"]]
                         for layer, sites in costs.items() for site, c in sites.items()},
  }
  return Bases(vectors, eigenvalues, trace, meta)


def solve(grams: dict, k_max: int, method: str = "eigh", progress: bool = False) -> Bases:
  """Bases from all layers' Gram matrices at once; meta records each site's solve."""
  _check_method(method, k_max)
  vectors, eigenvalues, trace, costs = {}, {}, {}, {}
  previous: dict = {}
  for layer in P.layers(grams):
    (vectors[layer], eigenvalues[layer], trace[layer],
     costs[layer]) = solve_layer(grams[layer], k_max, method, previous)
    if progress:
      logging.info("calibration %s: %s done", method, layer)
  return _bases(vectors, eigenvalues, trace, costs, method, k_max)


def windows(token_ids, seq_len: int) -> np.ndarray:
  """(N, seq_len) int32 windows from a 1-D id array (or windows as given)."""
  ids = np.asarray(token_ids, np.int32)
  if ids.size == 0:
    raise GSIError("calibration text is empty")
  if ids.ndim == 1:
    if len(ids) < seq_len:
      raise GSIError(f"calibration text has {len(ids)} tokens, fewer than one window of "
                     f"{seq_len}; give more text or a smaller seq_len")
    n = len(ids) // seq_len
    ids = ids[:n * seq_len].reshape(n, seq_len)
  return ids


@functools.partial(jax.jit, static_argnames=("module",))
def embed_windows(module, params, ids_BT):
  return module.apply({"params": params}, ids_BT, method=Decoder.embed_inputs)


@functools.lru_cache(maxsize=None)
def _zero_gram_program(d: int, where: NamedSharding | None):
  """One program per width and placement: a new jit a call compiled 3 programs a layer."""
  return jax.jit(lambda: jnp.zeros((d, d), jnp.float32), out_shardings=where)


def _zero_gram(d: int, where: NamedSharding | None) -> jax.Array:
  """A d x d float32 zero made in place on each device's rows: a host zero placed after
  would be a whole d x d temporary on every process (1 GiB at d = 16384)."""
  return _zero_gram_program(d, where)()


def _row_sharded(mesh: Mesh | None, d: int):
  """Gram matrices split by rows over the mesh (whole where the mesh does not divide d)."""
  if mesh is None:
    return None
  spec = PartitionSpec(sharding.AXIS, None) if d % mesh.devices.size == 0 else PartitionSpec()
  return NamedSharding(mesh, spec)


@functools.partial(jax.jit, static_argnames=("block",))
def layer_forward(layer_params, x_BTD, block):
  """One layer on one batch of windows: its output and its sites' inputs."""
  positions_T = jnp.arange(x_BTD.shape[1])
  (y_BTD, _), state = block.apply({"params": layer_params}, x_BTD, positions_T, 0, None, None,
                                  mutable=[P.SITE_INPUTS])
  return y_BTD, P.unwrap_sown(state[P.SITE_INPUTS])


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnums=(0,))
def _add_grams(grams, inputs, mesh):
  """Every site's Gram plus its inputs' XᵀX.  On a mesh each device adds to its own rows
  (shard_map): left to XLA, the in-place row loop over a row-split Gram held a whole
  d x d temporary on every device."""
  def add(gram, x):
    if mesh is None or _row_sharded(mesh, gram.shape[0]).spec == PartitionSpec():
      return _add_gram(gram, x)
    return jax.shard_map(
        lambda g, x: _add_gram(g, x, jax.lax.axis_index(sharding.AXIS) * g.shape[0]),
        mesh=mesh, in_specs=(PartitionSpec(sharding.AXIS, None), PartitionSpec()),
        out_specs=PartitionSpec(sharding.AXIS, None))(gram, x)
  return jax.tree.map(add, grams, inputs)


def calibrate(model, params, token_ids, k_max: int, method: str = "eigh", seq_len: int = 256,
              batch_size: int = 4, source: str = "", progress: bool = True,
              resume_dir: str | None = None, mesh: Mesh | None = None,
              on_layer=None) -> Bases:
  """Bases for every site, streamed layer by layer over the windows of `token_ids`.

  token_ids: a 1-D array of ids (cut into windows of seq_len) or (N, seq_len).
  method: "eigh" (exact), "krylov" (LOBPCG per layer) or "cascade" (each layer
  started from the previous layer's basis); see solve_site.
  resume_dir: an Orbax folder that receives each finished layer; a run with the
  same model, text and settings resumes after the last layer found there.
  mesh: shard the weights by columns (as sharding.shard_params) and the Gram
  matrices by rows across its devices.
  on_layer(done, layers, phase_seconds): called after each layer is solved (a benchmark
  saves what it measured so far).
  """
  check_model(model)
  P.check_tree(params)
  k_max, seq_len = whole("k_max", k_max), whole("seq_len", seq_len, 2)
  batch_size, progress = whole("batch_size", batch_size), flag("progress", progress)
  _check_method(method, k_max)
  token_ids = np.asarray(model.ids(token_ids, "calibration ids", 1 if np.ndim(token_ids) == 1
                                   else 2))
  ids = windows(token_ids, seq_len)
  model.check_length(ids.shape[1], "a calibration window")
  if k_max > P.widest_site(params):
    raise GSIError(f"k_max={k_max} exceeds the widest site ({P.widest_site(params)})")
  if mesh is not None:
    params = sharding.shard_params(params, mesh)
  meta = {"model": model.config.name, "source_model": model.source, "text_source": source,
          "tokens": int(ids.size), "seq_len": int(ids.shape[1]),
          **calibration_identity(model, params, ids)}
  run = {**meta, "method": method, "k_max": int(k_max)}
  store = LayerProgress(resume_dir, run) if resume_dir else None
  # A second run on the same resume_dir waits, then resumes after this one's layers.
  with exclusive(resume_dir) if store else contextlib.nullcontext():
    if store:
      RESUMABLE.add(resume_dir)
    try:
      bases = _stream_layers(model, params, ids, k_max, method, batch_size, progress, store,
                             mesh, on_layer)
    finally:
      RESUMABLE.discard(resume_dir)
  bases.meta.update(meta)
  return bases


# The resume folders of the calibrations running now: an interrupted run can say which
# calibration resumes, and says none where none was running.
RESUMABLE: set[str] = set()


PHASES = ("embed", "forward", "gram", "solve", "to_host", "save", "compile")


@contextlib.contextmanager
def _phase(seconds: dict, name: str, compiles: CompileEvents):
  """Adds the block's wall time to seconds[name], less JAX's lowering and compiling in it,
  which goes to seconds["compile"]."""
  start, compiling = time.perf_counter(), compiles.seconds
  yield
  spent = compiles.seconds - compiling
  seconds[name] += time.perf_counter() - start - spent
  seconds["compile"] += spent


def _stream_layers(model, params, ids, k_max: int, method: str, batch_size: int,
                   progress: bool, store: LayerProgress | None, mesh: Mesh | None,
                   on_layer=None) -> Bases:
  """calibrate's loop, each layer's phases timed apart: forward, Gram matrices, solve,
  copy to the host and save, then the next layer."""
  with CompileEvents() as compiles:
    seconds = dict.fromkeys(PHASES, 0.0)
    bases, first_layer_programs = _layer_loop(model, params, ids, k_max, method, batch_size,
                                              progress, store, mesh, seconds, compiles,
                                              on_layer)
  bases.meta.update(phase_seconds=seconds, programs_compiled=compiles.programs,
                    programs_compiled_after_first_layer=compiles.programs - first_layer_programs)
  return bases


def _layer_loop(model, params, ids, k_max, method, batch_size, progress, store, mesh,
                seconds: dict, compiles: CompileEvents, on_layer=None) -> tuple[Bases, int]:
  """(bases, programs compiled up to the end of the first layer this run computed)."""
  first_layer_programs = compiles.programs
  layer_names = P.layers(P.site_kernels(params))
  vectors, eigenvalues, trace, costs = {}, {}, {}, {}
  previous: dict = {}  # site -> the last layer's basis, where its solver reads it
  done, x_NTD = store.restore(vectors, eigenvalues, trace, costs) if store else (0, None)
  if done:
    previous = {site: vectors[layer_names[done - 1]][site]
                for site in vectors[layer_names[done - 1]]}
    logging.info("calibration resumes after %d of %d layers from %s", done,
                 len(layer_names), store.path)
  else:
    with _phase(seconds, "embed", compiles):
      x_NTD = jax.block_until_ready(jnp.concatenate([
          embed_windows(model.module, params, jnp.asarray(ids[i:i + batch_size]))
          for i in range(0, len(ids), batch_size)]))
  block = Block(model.config, model.dtype)
  # Every block has the same sites and widths: trace one once.
  _, shapes = jax.eval_shape(lambda p, x: layer_forward(p, x, block), params[layer_names[0]],
                             jnp.zeros((1, ids.shape[1], model.config.d_model), model.dtype))
  widths = {site: x.shape[-1] for site, x in shapes.items()}
  zeros = lambda: {site: _zero_gram(d, _row_sharded(mesh, d)) for site, d in widths.items()}
  # Keep a layer's site inputs when they are smaller than its Gram matrices, and add them
  # up after the forward: the forward's temporaries (XLA's CPU dot converts each bf16
  # weight to float32) and the Gram matrices are then never alive together.
  keep_inputs = ids.size * sum(widths.values()) < sum(d * d for d in widths.values())
  start = time.time()
  for index in range(done, len(layer_names)):
    layer = layer_names[index]
    t0 = time.time()
    # Where the inputs are not kept, the Gram matrices grow inside the forward's loop: the
    # "forward" phase then holds both.
    with _phase(seconds, "forward", compiles):
      grams, kept, outputs = (None if keep_inputs else zeros()), [], []
      for i in range(0, len(ids), batch_size):
        y, inputs = layer_forward(params[layer], x_NTD[i:i + batch_size], block)
        outputs.append(y)
        if keep_inputs:
          kept.append(inputs)
        else:
          grams = _add_grams(grams, inputs, mesh)
      x_NTD = jnp.concatenate(outputs)
      jax.block_until_ready((x_NTD, kept, grams))
    with _phase(seconds, "gram", compiles):
      if keep_inputs:
        grams = zeros()
        for inputs in kept:
          grams = _add_grams(grams, inputs, mesh)
        del kept
      jax.block_until_ready(grams)
    forward_s = time.time() - t0
    to_host = seconds["to_host"]
    with _phase(seconds, "solve", compiles):
      (vectors[layer], eigenvalues[layer], trace[layer],
       costs[layer]) = solve_layer(grams, k_max, method, previous, seconds)
    seconds["solve"] -= seconds["to_host"] - to_host
    check_layer(layer, vectors[layer], eigenvalues[layer], trace[layer],
                jnp.dtype(model.dtype).name)
    del grams  # one layer's Gram matrices alive at a time
    if index == done:
      first_layer_programs = compiles.programs
    if store:
      with _phase(seconds, "save", compiles):
        store.save(index, vectors[layer], eigenvalues[layer], trace[layer], costs[layer],
                   x_NTD)
    if progress:
      finished = index + 1 - done
      eta = (time.time() - start) / finished * (len(layer_names) - index - 1)
      progress_lines.say("calibration %s: %s (%d/%d) in %.1f s (forward %.1f s, solve %.1f "
                         "s); about %.0f s left", method, layer, index + 1, len(layer_names),
                         time.time() - t0, forward_s, time.time() - t0 - forward_s, eta)
    if on_layer is not None:
      on_layer(index + 1, len(layer_names), dict(seconds))
  return _bases(vectors, eigenvalues, trace, costs, method, k_max), first_layer_programs
