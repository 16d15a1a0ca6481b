"""A whole decode on one device: GPT-J-6B's shape at full depth, bf16 random weights made on
the device, greedy decoding of 1, 4 and 16 sequences, each method beside dense.

  PYTHONPATH=. python3 benchmarks/gpu_decode.py --out decode.json
  python benchmarks/gpu_decode.py --dry --out /tmp/decode.json   # gptj-tiny, any device

Methods, each a parameter tree and a gate of the same random model:
  dense          the model as made;
  gsi_static     GSI at rank --k, every token fast (mode "static");
  gsi_p0.9       GSI, each token fast with probability 0.9 at every site, whatever its
  gsi_p0.5       residual (mode "coin": the gate's pattern at a chosen rate), and 0.5;
  gsi_eps0       GSI at ε = 0: the gate cannot fire, so every site reads W alone;
  sparsity_0.5   TEAL-style magnitude sparsity keeping half of each site's inputs (its
                 thresholds: each site's median |x| on --calib_tokens random ids).
CATS thresholds a gated MLP's gate; GPT-J's MLP has none, so CATS has no point here.
Bases are random orthonormal V_k per site (a QR on the device) with M = V_kᵀ W: bytes
and speed do not depend on which basis, and quality on random weights means nothing.

Per batch, each method (--methods: all of them, or some) is timed beside dense in paired
rounds of its own (`benchmarking.decode_beside_each`): tokens/s of each (all sequences
together), the median ratio and its interval (95% from 6 rounds, else the range), compile
time apart.  At one sequence, one more decode of each gives the fast or kept shares its
byte ideal counts (`byte_ideal`); with several, a call reads a weight when any of its
tokens needs it, which per-token shares do not tell, so no ideal is given.  The JSON is
written after every method, so a run cut short keeps the rows it timed.
--dry: gptj-tiny, k = 16, batches 1 and 2, 4 new tokens, 2 rounds, where a flag does
not say otherwise: the whole path in a minute on a CPU.
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from gsi_jax import cli, experiment, make_gate, metrics, peers
from gsi_jax.measure.benchmarking import decode_beside_each, ratio_text
from gsi_jax.errors import GSIError
from gsi_jax.gsi.transform import images, site_rank
from gsi_jax.loading import synthetic
from gsi_jax.metrics import bytes as mbytes
from gsi_jax.models import params as P
from gsi_jax.models.model import _forward
from gsi_jax.ops import IMPLS

DRY = dict(shape="gptj-tiny", k=16, batch=["1", "2"], new_tokens=4, rounds=2, calib_tokens=64)
COIN_SHARES = (0.9, 0.5)
SPARSITY = 0.5
METHOD_NAMES = ("gsi_static", *(f"gsi_p{p}" for p in COIN_SHARES), "gsi_eps0",
                f"sparsity_{SPARSITY}")

_SHAPE = flags.DEFINE_enum("shape", "gptj-6b", list(synthetic.SHAPES), "Published shape.")
_LAYERS = flags.DEFINE_integer("layers", 0, "Blocks (0: the shape's full depth).")
_K = flags.DEFINE_integer("k", 256, "GSI's rank.")
_BATCH = flags.DEFINE_list("batch", ["1", "4", "16"], "Sequences decoded at once.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Random prompt ids per sequence.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 32, "Tokens per timed decode.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Paired rounds per batch.")
_CALIB_TOKENS = flags.DEFINE_integer("calib_tokens", 256, "Random ids whose site inputs set "
                                     "sparsity's thresholds.")
_METHODS = flags.DEFINE_list("methods", list(METHOD_NAMES), "Methods timed beside dense.")
_IMPL = flags.DEFINE_enum("impl", "auto", list(IMPLS), "Gate impl (auto: the kernels on a GPU).")
_DRY = flags.DEFINE_bool("dry", False, "Small shapes: the whole path in a minute, any device.")
_OUT = flags.DEFINE_string("out", None, "JSON output.")


@dataclasses.dataclass(frozen=True)
class DecodeBenchConfig:
  shape: str
  layers: int
  k: int
  batches: tuple[int, ...]
  prompt_len: int
  new_tokens: int
  rounds: int
  calib_tokens: int
  impl: str
  out: str
  methods: tuple[str, ...] = METHOD_NAMES

  def __post_init__(self):
    for name in ("k", "prompt_len", "new_tokens", "rounds", "calib_tokens"):
      experiment.positive(f"--{name}", getattr(self, name))
    if self.layers < 0:
      raise GSIError(f"--layers must be >= 0 (0: the full depth), got {self.layers}")
    unknown = sorted(set(self.methods) - set(METHOD_NAMES))
    if unknown or not self.methods:
      raise GSIError(f"--methods: unknown {unknown or 'none given'}; choose from "
                     f"{', '.join(METHOD_NAMES)} (dense is timed beside each)")
    if not self.batches or any(b < 1 for b in self.batches):
      raise GSIError(f"--batch takes positive whole numbers, got {list(self.batches)}")
    config = synthetic.hf_config(self.shape)
    positions = getattr(config, "n_positions", None) or config.max_position_embeddings
    if self.prompt_len + self.new_tokens > positions:
      raise GSIError(f"--prompt_len ({self.prompt_len}) plus --new_tokens ({self.new_tokens}) "
                     f"exceeds {self.shape}'s {positions} positions; lower them")


def config_from_flags() -> DecodeBenchConfig:
  pick = cli.preset_or_flag(DRY if _DRY.value else None)
  if not _OUT.value:
    raise GSIError("--out is required: the JSON this run writes")
  return DecodeBenchConfig(
      shape=pick("shape", _SHAPE), layers=_LAYERS.value, k=pick("k", _K),
      batches=tuple(cli.numbers("batch", pick("batch", _BATCH), int)),
      prompt_len=_PROMPT_LEN.value, new_tokens=pick("new_tokens", _NEW_TOKENS),
      rounds=pick("rounds", _ROUNDS), calib_tokens=pick("calib_tokens", _CALIB_TOKENS),
      impl=_IMPL.value, out=_OUT.value, methods=tuple(_METHODS.value))


def random_gsi(params, k: int, seed: int = 0):
  """Params whose every site holds a random orthonormal V_k (d, k) and M = V_kᵀ W, made on
  the device."""
  out = params
  for i, (layer, sites) in enumerate(P.site_kernels(params).items()):
    for j, (site, kernels) in enumerate(sites.items()):
      W = next(iter(kernels.values()))
      key = jax.random.fold_in(jax.random.key(seed), 1000 * i + j)
      d = W.shape[0]
      V_DK, _ = jnp.linalg.qr(jax.random.normal(key, (d, site_rank(k, d)), jnp.float32))
      V_DK = V_DK.astype(W.dtype)
      out = P.with_site(out, layer, site, {P.V: V_DK, P.M: images(V_DK, kernels)})
  return out


def methods(c: DecodeBenchConfig, model, rng) -> list[tuple[str, dict, object]]:
  """(name, params, gate) of every method c.methods names, in METHOD_NAMES' order."""
  gate = lambda eps, mode="gated": make_gate(eps, mode, impl=c.impl, batch1_switch=True)
  out = []
  if any(name.startswith("gsi_") for name in c.methods):
    gsi = random_gsi(model.params, c.k)
    out += [("gsi_static", gsi, gate(0.0, "static")),
            *[(f"gsi_p{p}", gsi, gate(p, "coin")) for p in COIN_SHARES],
            ("gsi_eps0", gsi, gate(0.0))]
  if f"sparsity_{SPARSITY}" in c.methods:
    ids = rng.integers(0, model.config.vocab_size, (1, c.calib_tokens)).astype(np.int32)
    sparse = peers.apply_sparsity(
        model.params, peers.sparsity_thresholds(model, model.params, ids, SPARSITY))
    out.append((f"sparsity_{SPARSITY}", sparse, gate(0.0)))
  return [point for point in out if point[0] in c.methods]


def byte_ideal(model, params, gate, prompt, new_tokens: int) -> dict:
  """At one sequence, a decoded token's weight bytes against dense's: a GSI tree by the fast
  shares its decode measured (`metrics.byte_accounting`), a sparse one by the kept shares
  of the decode's tokens run again as one forward (`metrics.bytes.sparsity_bytes`)."""
  out, stats = model.generate(params, prompt, new_tokens, gate, return_stats=True,
                              stop_at_eos=False)
  dense = metrics.byte_accounting(model.params)["bytes_per_token_dense"]
  share = stats["fast_share_by_layer"]
  if share:
    b = metrics.byte_accounting(params, share, stats["rows_by_layer"])
    return {"fast_share": metrics.mean_share(share), "byte_ideal_speedup": b["speedup_bytes"]}
  _, state = _forward(model.module, params, out, gate, ("sparsity_stats",))
  decoded = lambda kept: float(np.mean(np.asarray(kept["kept"][0])[:, prompt.shape[1]:]))
  kept = {layer: {site: decoded(v) for site, v in sites.items()}
          for layer, sites in state["sparsity_stats"].items()}
  return {"kept_share": metrics.mean_share(kept),
          "byte_ideal_speedup": dense / mbytes.sparsity_bytes(params, kept, None)}


def run(c: DecodeBenchConfig, save=lambda result: None) -> dict:
  """Every batch of c.batches, each method beside dense; save(result) after each method."""
  model = synthetic.random_model(c.shape, "bfloat16", c.layers or None)
  rng = np.random.default_rng(0)
  points = methods(c, model, rng)
  result = {"device": str(jax.devices()[0]), "jax_version": jax.__version__,
            "config": dataclasses.asdict(c), "n_layers": model.config.n_layers,
            "methods": ["dense"] + [name for name, _, _ in points],
            "not_run": {"cats_0.5": f"{c.shape}'s MLP is not gated; CATS thresholds a gate"},
            "dense_bytes_per_token":
                metrics.byte_accounting(model.params)["bytes_per_token_dense"],
            "batches": []}
  for batch in c.batches:
    prompt = rng.integers(0, model.config.vocab_size, (batch, c.prompt_len)).astype(np.int32)
    rows = []
    result["batches"].append({"batch": batch, "points": rows})
    for name, params, gate in points:
      (t,) = decode_beside_each(model, prompt, c.new_tokens, c.rounds, [(params, gate)],
                                model.params)
      ideal = byte_ideal(model, params, gate, prompt, c.new_tokens) if batch == 1 else {}
      rows.append({"method": name, "gate_mode": gate.mode, "eps": float(gate.eps), **t,
                   "tokens_per_s": batch * t["tokens_per_s"],
                   "dense_tokens_per_s": batch * t["dense_tokens_per_s"], **ideal})
      logging.info("batch %d %s: %.1f tokens/s (dense beside it %.1f), %s%s; compiled in "
                   "%.1f s", batch, name, rows[-1]["tokens_per_s"],
                   rows[-1]["dense_tokens_per_s"],
                   ratio_text(t["measured_speedup"], t["speedup_low"], t["speedup_high"]),
                   f", byte ideal x{ideal['byte_ideal_speedup']:.2f}" if ideal else "",
                   t["compile_s"])
      save(result)
  return result


def main(argv):
  del argv
  c = config_from_flags()
  out = experiment.check_output_path(c.out)
  experiment.write_json(out, run(c, lambda result: experiment.write_json(out, result,
                                                                         partial=True)))


if __name__ == "__main__":
  cli.run(main, one_process="decodes on one device")
