"""A whole model through the Pallas kernel (interpret mode here) against impl="xla"."""

import dataclasses

import numpy as np
import pytest

import gsi_jax
from gsi_jax import make_gate
from gsi_jax.models import params as P

RNG = np.random.default_rng(0)
CALIB = RNG.integers(0, 101, (8, 16)).astype(np.int32)
EVAL = RNG.integers(0, 101, (2, 12)).astype(np.int32)


def fast_masks(model, params, ids, gate):
  _, state = model.forward(params, ids, gate)
  return {(layer, site): np.asarray(v["fast"][0])
          for layer, sites in state["gate_stats"].items() for site, v in sites.items()}


def compare(model, params, ids, eps, atol):
  xla, pallas = make_gate(eps), make_gate(eps, impl="pallas")
  a = np.asarray(model.logits(params, ids, xla))
  b = np.asarray(model.logits(params, ids, pallas))
  np.testing.assert_allclose(b, a, atol=atol * np.abs(a).max(), rtol=0)
  ma, mb = fast_masks(model, params, ids, xla), fast_masks(model, params, ids, pallas)
  assert ma.keys() == mb.keys()
  for key in ma:
    np.testing.assert_array_equal(ma[key], mb[key], err_msg=str(key))
  return np.mean([m.mean() for m in ma.values()])


# MHA with biases (gpt2) and GQA with a gated MLP (llama_gqa): GPT-J's and OPT's maps add
# no new kind of call for the kernel, and cost ~40 s each here.
@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_tiny_models_through_the_kernel(tiny_folder, name):
  model = gsi_jax.load_model(tiny_folder(name)[0])
  bases = gsi_jax.calibrate(model, model.params, CALIB, k_max=12, seq_len=16, progress=False)
  params = gsi_jax.apply_gsi(model.params, bases, 12)
  shares = [compare(model, params, EVAL, eps, 1e-5) for eps in (0.0, 0.6, float("inf"))]
  assert shares[0] == 0 and 0 < shares[1] < 1 and shares[2] == 1
  # Greedy decoding (batch 1 and 2) through the kernel: the same tokens.
  for rows in (1, 2):
    want = model.generate(params, EVAL[:rows, :4], 8, make_gate(0.6), stop_at_eos=False)
    got = model.generate(params, EVAL[:rows, :4], 8, make_gate(0.6, impl="pallas"),
                         stop_at_eos=False)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_gated_head_through_the_kernel(tiny_folder):
  """A tied head: the kernel reads the embedding table as stored, (vocab, d)."""
  model = gsi_jax.load_model(tiny_folder("llama_gqa")[0])
  V, _, _ = gsi_jax.head_basis(model, model.params, CALIB, 16)
  params = gsi_jax.apply_gsi_head(model.params, V, 8)
  for head_eps in (0.0, 0.5, float("inf")):
    a = np.asarray(model.logits(params, EVAL, make_gate(0.0, head_eps=head_eps)))
    b = np.asarray(model.logits(params, EVAL, make_gate(0.0, head_eps=head_eps, impl="pallas")))
    np.testing.assert_allclose(b, a, atol=1e-5 * np.abs(a).max(), rtol=0)


def test_default_model_layers_through_the_kernel():
  """The first layers of the default model (d = 576, its own widths: no padding)."""
  from gsi_jax import text
  model = gsi_jax.load_model("smollm2-135m")
  cfg = dataclasses.replace(model.config, n_layers=3)
  small = dataclasses.replace(model, config=cfg, params={
      k: v for k, v in model.params.items() if not P.is_layer(k) or P.layer_index(k) < 3})
  ids = text.windows(small, text.PYDOC_CALIB, 64, 512).ids
  bases = gsi_jax.calibrate(small, small.params, ids, 256, progress=False)
  params = gsi_jax.apply_gsi(small.params, bases, 256)
  held_out = text.windows(small, text.PYDOC_EVAL, 16, 32).ids
  share = compare(small, params, held_out, 0.3, 1e-4)
  assert 0 < share < 1
