"""The embedded default model (SmolLM2-135M GGUF) against transformers' GGUF loader."""

import os

import numpy as np
import pytest
import torch

import gsi_jax
from gsi_jax.loading.load import PRESETS, _package_file

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def ours():
  return gsi_jax.load_model("smollm2-135m")


@pytest.fixture(scope="module")
def reference():
  from transformers import AutoModelForCausalLM, AutoTokenizer
  path = _package_file(PRESETS["smollm2-135m"])
  folder, name = os.path.split(path)
  return (AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).eval(),
          AutoTokenizer.from_pretrained(folder, gguf_file=name))


def test_tokenizer_matches_transformers(ours, reference):
  _, tok = reference
  for text in [PROMPT, "def f(x):\n    return x ** 2  # 12345", "<|im_start|>user\nHi!<|im_end|>"]:
    assert list(ours.encode(text)) == tok(text)["input_ids"]


def test_logits_and_greedy_match_transformers(ours, reference):
  model, tok = reference
  ids = np.asarray(tok(PROMPT)["input_ids"], np.int32)[None]
  got = np.asarray(ours.logits(ours.params, ids))
  with torch.no_grad():
    want = model(torch.from_numpy(ids).long()).logits.numpy()
  scale = np.abs(want).max()
  assert np.abs(got - want).max() <= 1e-3 * scale
  ours_ids = np.asarray(ours.generate(ours.params, ids, max_new_tokens=20, stop_at_eos=False))
  with torch.no_grad():
    ref_ids = model.generate(torch.from_numpy(ids).long(), max_new_tokens=20,
                             min_new_tokens=20, do_sample=False).numpy()
  np.testing.assert_array_equal(ours_ids, ref_ids)
