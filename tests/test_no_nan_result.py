"""No NaN is ever a result: logits, a decode, scoring and calibration refuse non-finite
values in one line naming the dtype and the fix, and nothing reads past a learned position
table."""

import jax
import numpy as np
import pytest

import gsi_jax
from gsi_jax import GSIError, metrics

WINDOWS = np.arange(32, dtype=np.int32).reshape(2, 16) % 100 + 1
FLOAT16 = r"in float16; float16's range \(65504\) overflowed: load the model with dtype="


@pytest.fixture(scope="module")
def overflowing(tiny_folder):
  """GPT-2 (tiny) in float16 with a first MLP scaled until its activations pass 65504."""
  model = gsi_jax.load_model(tiny_folder("gpt2")[0], "float16")
  params = jax.tree.map(lambda x: x, model.params)
  for site, scale in (("mlp_in", 300), ("mlp_out", 3000)):
    params["layer_0"][site] = jax.tree.map(lambda x, s=scale: x * s, params["layer_0"][site])
  return model, params


def test_logits_that_overflow_are_refused(overflowing):
  model, params = overflowing
  with pytest.raises(GSIError, match="^the logits hold NaN or inf " + FLOAT16):
    model.logits(params, [[1, 2, 3]])
  np.testing.assert_array_equal(np.isfinite(model.logits(model.params, [[1, 2, 3]])), True)


def test_no_token_is_drawn_from_nonfinite_logits(overflowing):
  model, params = overflowing
  with pytest.raises(GSIError, match=r"^the logits of new token 1 of 4 hold NaN or inf " + FLOAT16):
    model.generate(params, [[1, 2, 3]], 4)
  with pytest.raises(GSIError, match="hold NaN or inf"):
    model.generate(params, [[1, 2, 3]], 4, gsi_jax.make_gate(0.1, mode="dense"), return_stats=True)


def test_a_decode_that_turns_nonfinite_midway_is_refused(tiny_folder):
  """Finite over the prompt (14 tokens, padded to 16), then a position whose embedding is
  NaN: the token drawn there is the fourth, and the loop stops at it."""
  model = gsi_jax.load_model(tiny_folder("gpt2")[0])
  params = jax.tree.map(lambda x: x, model.params)
  params["pos_embed"]["embedding"] = params["pos_embed"]["embedding"].at[16].set(np.nan)
  prompt = np.arange(1, 15, dtype=np.int32)[None]
  assert model.generate(params, prompt, 3, stop_at_eos=False).shape == (1, 17)
  with pytest.raises(GSIError, match=r"^the logits of new token 4 of 6 hold NaN or inf in "
                                     r"float32; the weights .* hold NaN or inf"):
    model.generate(params, prompt, 6, stop_at_eos=False)


def test_scoring_never_reports_a_nan_perplexity(overflowing):
  model, params = overflowing
  with pytest.raises(GSIError, match="^the scored log-probabilities hold NaN or inf " + FLOAT16):
    metrics.score(model, params, WINDOWS)


def test_calibration_checks_bases_as_it_makes_them(overflowing):
  """Without a resume folder or a cache, too: the layer and the fix are named."""
  model, params = overflowing
  with pytest.raises(GSIError, match=r"^calibration of layer_\d failed: .* holds non-finite "
                                     r"values; a float16 forward overflows past 65504"):
    gsi_jax.calibrate(model, params, np.concatenate([WINDOWS, WINDOWS]), 4, seq_len=16)


def test_nothing_reads_past_a_learned_position_table(tiny_folder):
  model = gsi_jax.load_model(tiny_folder("gpt2")[0])  # 64 positions
  too_long = np.ones((1, 65), np.int32)
  with pytest.raises(GSIError, match="input_ids of 65 tokens exceeds .* 64 positions"):
    model.logits(model.params, too_long)
  with pytest.raises(GSIError, match="a scoring window of 65 tokens exceeds"):
    metrics.score(model, model.params, too_long)
  with pytest.raises(GSIError, match="a calibration window of 65 tokens exceeds"):
    gsi_jax.calibrate(model, model.params, np.ones((2, 65), np.int32), 4, seq_len=65)
  with pytest.raises(GSIError, match="prompt plus new tokens of 66 tokens exceeds"):
    model.generate(model.params, too_long[:, :60], 6)
  assert model.logits(model.params, too_long[:, :64]).shape == (1, 64, 101)
