"""What users expect of generate: a GSI gate needs bases to gate, and the gate statistics
count only the rows still decoding."""

import numpy as np
import pytest

import gsi_jax
from gsi_jax import GSIError, metrics

CALIB = (np.arange(96, dtype=np.int32) % 97 + 1).reshape(-1, 16)


@pytest.fixture(scope="module")
def gsi_model(tiny_folder):
  model = gsi_jax.load_model(tiny_folder("gpt2")[0])
  bases = gsi_jax.calibrate(model, model.params, CALIB, 8, seq_len=16)
  return model, gsi_jax.apply_gsi(model.params, bases, 4)


@pytest.mark.parametrize("gate", [gsi_jax.make_gate(0.1), gsi_jax.make_gate(0.0, "static"),
                                  gsi_jax.make_gate(0.0, head_eps=0.2)])
def test_a_gsi_gate_over_parameters_without_bases_is_refused(gsi_model, gate):
  model, _ = gsi_model
  for call in (lambda: model.generate(model.params, [[1, 2, 3]], 2, gate),
               lambda: model.logits(model.params, [[1, 2, 3]], gate),
               lambda: metrics.score(model, model.params, CALIB[:1], gate)):
    with pytest.raises(GSIError, match="GSI gate over parameters that hold no bases would "
                                       "run as dense"):
      call()


def test_a_gate_that_never_takes_a_gsi_path_runs_over_dense_parameters(gsi_model):
  model, _ = gsi_model
  for gate in (gsi_jax.make_gate(0.0), gsi_jax.make_gate(0.3, "dense")):
    np.testing.assert_array_equal(model.generate(model.params, [[1, 2, 3]], 3, gate),
                                  model.generate(model.params, [[1, 2, 3]], 3))


def test_finished_rows_are_not_counted_in_the_gate_statistics(gsi_model):
  """Row 0 ends at its first token (until_differs); the decode steps' statistics are then
  row 1's alone, as a decode of row 1 by itself counts them."""
  model, params = gsi_model
  gate = gsi_jax.make_gate(0.5)
  prompts = np.array([[5, 17, 3, 99], [9, 2, 77, 31]], np.int32)
  alone = model.generate(params, prompts[1:], 8, gate, stop_at_eos=False)
  _, want = model.generate(params, prompts[1:], 8, gate, return_stats=True,
                           stop_at_eos=False, until_differs=alone[:, 4:])
  first = int(np.asarray(model.generate(params, prompts[:1], 1, gate))[0, -1])
  reference = np.stack([np.full(8, (first + 1) % 101), np.asarray(alone)[0, 4:]])
  out, got = model.generate(params, prompts, 8, gate, return_stats=True, stop_at_eos=False,
                            until_differs=reference)
  assert np.asarray(out).shape[1] == 12
  shares = [s for sites in want["fast_share_by_layer"].values() for s in sites.values()]
  assert 0 < np.mean(shares) < 1  # the gate is neither always slow nor always fast here
  for layer, sites in want["fast_share_by_layer"].items():
    for site, share in sites.items():
      assert got["fast_share_by_layer"][layer][site] == pytest.approx(share, abs=1e-6)
      assert got["rows_by_layer"][layer][site] == pytest.approx(
          want["rows_by_layer"][layer][site], abs=1e-5)


PROMPTS = [[5, 17, 3], [9, 2, 77, 31, 4], [8, 1, 64, 23, 11], [42, 7]]


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa", "opt"])
def test_prompts_of_different_lengths_decode_each_as_it_would_alone(tiny_folder, name):
  model = gsi_jax.load_model(tiny_folder(name)[0])
  out = np.asarray(model.generate(model.params, PROMPTS, 6, stop_at_eos=False))
  T = max(map(len, PROMPTS))
  assert out.shape == (len(PROMPTS), T + 6)
  for row, prompt in zip(out, PROMPTS):
    alone = np.asarray(model.generate(model.params, [prompt], 6, stop_at_eos=False))[0]
    np.testing.assert_array_equal(row[T - len(prompt):], alone)
    assert (row[:T - len(prompt)] == (model.eos_ids or (0,))[0]).all()
  # The same prompts padded on the left with a mask, as a tokenizer pads them.
  mask = np.array([[0] * (T - len(p)) + [1] * len(p) for p in PROMPTS])
  padded = np.array([[3] * (T - len(p)) + p for p in PROMPTS])
  masked = np.asarray(model.generate(model.params, padded, 6, stop_at_eos=False,
                                     attention_mask=mask))
  np.testing.assert_array_equal(masked[:, T:], out[:, T:])
  np.testing.assert_array_equal(masked[:, :T], padded)


def test_rows_of_different_lengths_stop_apart_and_count_once(gsi_model):
  """A row that stops first repeats its last token; the statistics are the tokens the
  rows decoded, summed over the lengths' decodes."""
  model, params = gsi_model
  gate = gsi_jax.make_gate(0.5)
  short = np.asarray(model.generate(params, [PROMPTS[0]], 6, gate, stop_at_eos=False))[0]
  until = np.array([[(short[3] + 1) % 101] * 6, [-1] * 6])  # row 0 ends at its first token
  out, stats = model.generate(params, [PROMPTS[0], PROMPTS[1]], 6, gate, return_stats=True,
                              stop_at_eos=False, until_differs=until)
  out = np.asarray(out)
  assert (out[0, 5:] == short[3]).all()
  _, alone = model.generate(params, [PROMPTS[1]], 6, gate, return_stats=True,
                            stop_at_eos=False)
  for layer, sites in alone["fast_share_by_layer"].items():
    for site, share in sites.items():
      assert stats["fast_share_by_layer"][layer][site] == pytest.approx(share, abs=1e-6)


@pytest.mark.parametrize("mask, message", [
    ([[1, 1, 0], [1, 1, 1]], "must pad on the left"),
    ([[0, 0, 0], [1, 1, 1]], "must pad on the left"),
    ([[0, 1, 1]], "of the prompt's shape"),
    ([[0, 2, 1], [1, 1, 1]], "must be 0s and 1s"),
])
def test_an_attention_mask_that_is_not_left_padding_is_refused(gsi_model, mask, message):
  model, _ = gsi_model
  with pytest.raises(GSIError, match=message):
    model.generate(model.params, [[1, 2, 3], [4, 5, 6]], 2, attention_mask=mask)
