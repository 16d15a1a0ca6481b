"""Every public function checks its arguments: bases where bases belong, numbers that are
numbers, booleans that are booleans, layers and sites the model has.  Anything else is one
GSIError naming the argument, never an AttributeError, KeyError or TypeError from inside."""

import numpy as np
import pytest

import gsi_jax
from gsi_jax import GSIError, metrics

CALIB = (np.arange(96, dtype=np.int32) % 97 + 1).reshape(-1, 16)


@pytest.fixture(scope="module")
def setup(tiny_folder, tmp_path_factory):
  model = gsi_jax.load_model(tiny_folder("gpt2")[0])
  bases = gsi_jax.calibrate(model, model.params, CALIB, 8, seq_len=16, progress=False)
  bare = gsi_jax.load_model(tiny_folder("gpt2")[0])
  bare.tokenizer = None
  return model, bases, gsi_jax.apply_gsi(model.params, bases, 4), bare, tmp_path_factory


CASES = {
    "apply_gsi bases": (lambda m, b, p: gsi_jax.apply_gsi(m.params, {}, 4), "bases must be"),
    "apply_gsi params": (lambda m, b, p: gsi_jax.apply_gsi(None, b, 4), "params must be"),
    "truncate_ranks layer": (lambda m, b, p: gsi_jax.truncate_ranks(p, {"layer_9": {"attn_in": 2}}),
                             "ranks names 'layer_9', not a layer of this model"),
    "truncate_ranks site": (lambda m, b, p: gsi_jax.truncate_ranks(p, {"layer_0": {"qkv": 2}}),
                            "ranks names layer_0/'qkv', not a site"),
    "truncate_ranks ranks": (lambda m, b, p: gsi_jax.truncate_ranks(p, None), "ranks must map"),
    "apply_residual_sparsity layer": (
        lambda m, b, p: gsi_jax.apply_residual_sparsity(p, {"layer_7": {"attn_in": 0.1}}),
        "thresholds names 'layer_7'"),
    "apply_residual_sparsity number": (
        lambda m, b, p: gsi_jax.apply_residual_sparsity(p, {"layer_0": {"attn_in": "0.1"}}),
        "thresholds layer_0/attn_in must be a number"),
    "calibrate model": (lambda m, b, p: gsi_jax.calibrate(None, m.params, CALIB, 8),
                        "model must be what load_model returns"),
    "calibrate progress": (lambda m, b, p: gsi_jax.calibrate(m, m.params, CALIB, 8,
                                                             progress="no"),
                           "progress must be True or False"),
    "make_gate eps": (lambda m, b, p: gsi_jax.make_gate("0.1"), "eps must be a number"),
    "make_gate batch1_switch": (lambda m, b, p: gsi_jax.make_gate(0.1, batch1_switch=1),
                                "batch1_switch must be True or False"),
    "generate return_stats": (lambda m, b, p: m.generate(p, [[1, 2]], 2, return_stats="yes"),
                              "return_stats must be True or False"),
    "generate stop_at_eos": (lambda m, b, p: m.generate(p, [[1, 2]], 2, stop_at_eos="no"),
                             "stop_at_eos must be True or False"),
    "generate params": (lambda m, b, p: m.generate(None, [[1, 2]], 2), "params must be"),
    "logits params": (lambda m, b, p: m.logits({}, [[1, 2]]), "params must be"),
    "score model": (lambda m, b, p: metrics.score(None, p, CALIB), "model must be"),
    "score batch_size": (lambda m, b, p: metrics.score(m, p, CALIB, batch_size="4"),
                         "batch_size must be a whole number"),
    "byte_accounting params": (lambda m, b, p: metrics.byte_accounting(None), "params must be"),
    "byte_accounting shares": (lambda m, b, p: metrics.byte_accounting(p, {"layer_0": 1}),
                               "fast_share_by_layer must map layers"),
    "apply_gsi_head basis": (lambda m, b, p: gsi_jax.apply_gsi_head(m.params, None, 2),
                             "the head basis must be a .d, k. array"),
    "depth_coherence bases": (lambda m, b, p: gsi_jax.depth_coherence(None, 4),
                              "bases must be"),
    "depth_coherence k": (lambda m, b, p: gsi_jax.depth_coherence(b, "4"),
                          "k must be a whole number"),
    "dense_params params": (lambda m, b, p: gsi_jax.dense_params(None), "params must be"),
    "save_bases path": (lambda m, b, p: gsi_jax.save_bases(None, b), "path must be a path"),
    "save_bases bases": (lambda m, b, p: gsi_jax.save_bases("unused", p),
                         "bases must be the Bases"),
    "load_bases k": (lambda m, b, p: gsi_jax.load_bases(".", k="4"), "k must be a whole number"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wrong_argument_is_one_error_naming_it(setup, name):
  model, bases, params, _, _ = setup
  call, message = CASES[name]
  with pytest.raises(GSIError, match=message):
    call(model, bases, params)


def test_decoding_ids_without_a_tokenizer_says_so(setup):
  _, _, _, bare, _ = setup
  for call in (lambda: bare.decode([1, 2]), lambda: bare.encode("text")):
    with pytest.raises(GSIError, match="has no tokenizer"):
      call()
