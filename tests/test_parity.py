"""Logits and greedy ids match Hugging Face PyTorch on tiny random models."""

import numpy as np
import pytest
import torch

import gsi_jax
from tests.hf_models import TINY

IDS = np.array([[5, 17, 3, 99, 42, 7, 0, 64, 23, 11, 8, 1],
                [9, 2, 77, 31, 100, 4, 56, 12, 90, 3, 44, 6]], np.int32)


@pytest.mark.parametrize("name", sorted(TINY))
def test_logits_match_torch(tiny_folder, name):
  folder, ref = tiny_folder(name)
  model = gsi_jax.load_model(folder)
  got = np.asarray(model.logits(model.params, IDS))
  with torch.no_grad():
    want = ref(torch.from_numpy(IDS).long()).logits.numpy()
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(TINY))
def test_kv_cache_decode_equals_full_forward(tiny_folder, name):
  folder, _ = tiny_folder(name)
  model = gsi_jax.load_model(folder)
  out = np.asarray(model.generate(model.params, IDS[:, :4], max_new_tokens=8, stop_at_eos=False))
  # Each generated token is the argmax of a full forward over the prefix.
  full = np.asarray(model.logits(model.params, out[:, :-1]))
  np.testing.assert_array_equal(out[:, 4:], full[:, 3:].argmax(-1))


def test_prompts_of_one_bucket_share_one_program_and_decode_exactly(tiny_folder):
  """Prompts are padded on the right to PROMPT_BUCKET tokens: lengths 3, 4 and 9 compile
  one decode program, and each still decodes the argmax of a full forward over its own
  prefix.  GPT-2's 64 positions leave no room to pad 50 + 12 tokens: unpadded, exact."""
  from gsi_jax.models import model as model_module
  model = gsi_jax.load_model(tiny_folder("gpt2")[0])
  before = model_module._generate._cache_size()
  for T, n in ((3, 6), (4, 6), (9, 6), (50, 12)):
    out = np.asarray(model.generate(model.params, IDS[:, :1].repeat(T, 1) + np.arange(T),
                                    max_new_tokens=n, stop_at_eos=False))
    full = np.asarray(model.logits(model.params, out[:, :-1]))
    np.testing.assert_array_equal(out[:, T:], full[:, T - 1:].argmax(-1))
  assert model_module._generate._cache_size() - before == 2  # one bucket, then unpadded
  assert (model.cache_tokens(9, 6), model.cache_tokens(50, 12)) == (16 + 6, 50 + 12)


@pytest.mark.parametrize("name", sorted(TINY))
def test_greedy_equals_hf_generate(tiny_folder, name):
  folder, ref = tiny_folder(name)
  model = gsi_jax.load_model(folder)
  got = np.asarray(model.generate(model.params, IDS[:, :5], max_new_tokens=10,
                                  stop_at_eos=False))
  with torch.no_grad():
    want = ref.generate(torch.from_numpy(IDS[:, :5]).long(), max_new_tokens=10,
                        min_new_tokens=10, do_sample=False, eos_token_id=None,
                        pad_token_id=0).numpy()
  np.testing.assert_array_equal(got, want)


def test_pytorch_bin_checkpoint(tmp_path):
  from tests import hf_models
  ref = hf_models.save("gpt2", tmp_path, torch_bin=True)
  assert not list(tmp_path.glob("*.safetensors"))
  model = gsi_jax.load_model(str(tmp_path))
  with torch.no_grad():
    want = ref(torch.from_numpy(IDS).long()).logits.numpy()
  np.testing.assert_allclose(np.asarray(model.logits(model.params, IDS)), want, atol=1e-4)


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_greedy_stops_at_eos_like_hf(tiny_folder, name):
  """With an end-of-sequence id the model does produce, both stop at the same length."""
  import dataclasses
  folder, ref = tiny_folder(name)
  model = gsi_jax.load_model(folder)
  free = np.asarray(model.generate(model.params, IDS[:, :5], 10, stop_at_eos=False))
  eos = int(free[0, 8])  # row 0 produces it by step 4 at the latest
  model = dataclasses.replace(model, eos_ids=(eos,))
  got = np.asarray(model.generate(model.params, IDS[:, :5], 10))
  with torch.no_grad():
    want = ref.generate(torch.from_numpy(IDS[:, :5]).long(), max_new_tokens=10,
                        do_sample=False, eos_token_id=eos, pad_token_id=eos).numpy()
  np.testing.assert_array_equal(got, want)
  assert got.shape[1] <= free.shape[1]


def test_generate_until_differs_stops_at_the_first_other_token(tiny_folder):
  """A reference decode's own tokens run to the end; one changed token stops each row
  there, keeping the model's token, so the two outputs are equal exactly when the full
  decodes are."""
  from gsi_jax import GSIError
  model = gsi_jax.load_model(tiny_folder("llama_gqa")[0])
  prompt = IDS[:1, :5]
  free = np.asarray(model.generate(model.params, prompt, 10, stop_at_eos=False))
  same = np.asarray(model.generate(model.params, prompt, 10, stop_at_eos=False,
                                   until_differs=free[:, 5:]))
  np.testing.assert_array_equal(same, free)
  for step in (0, 4):
    other = free[:, 5:].copy()
    other[0, step] = (other[0, step] + 1) % model.config.vocab_size
    stopped = np.asarray(model.generate(model.params, prompt, 10, stop_at_eos=False,
                                        until_differs=other))
    np.testing.assert_array_equal(stopped, free[:, :5 + step + 1])
  with pytest.raises(GSIError, match="until_differs takes"):
    model.generate(model.params, prompt, 10, until_differs=free[0])


def test_generate_refuses_past_the_position_table(tiny_folder):
  model = gsi_jax.load_model(tiny_folder("gpt2")[0])  # 64 learned positions
  from gsi_jax import GSIError
  with pytest.raises(GSIError, match="exceeds .* 64 positions"):
    model.generate(model.params, IDS[:, :5], 60)
  with pytest.raises(GSIError, match="at least one token"):
    model.generate(model.params, IDS[:, :0], 5)
  with pytest.raises(GSIError, match="max_new_tokens must be >= 1"):
    model.generate(model.params, IDS[:, :5], 0)
