"""The paper's models and the default model as the hub ships their config.json.

tests/fixtures/hub_configs/ holds each config.json as published (EleutherAI/gpt-j-6b,
openai-community/gpt2 and gpt2-medium, facebook/opt-125m, opt-350m, opt-1.3b, opt-2.7b and
opt-6.7b, HuggingFaceTB/SmolLM2-135M).  Each must translate, the presets must be exactly what their
hub configs say, and a tiny random model that keeps every other key of a hub config loads
and matches transformers.
"""

import copy
import inspect
import json
import os
import re

import numpy as np
import pytest

import gsi_jax
from gsi_jax.errors import GSIError
from gsi_jax.loading import hf_config
from gsi_jax.loading.hf_config import config_from_hf
from gsi_jax.models.config import ModelConfig

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hub_configs")
NAMES = sorted(f[:-len(".json")] for f in os.listdir(FIXTURES) if f.endswith(".json"))
PRESETS = {"gptj-6b": ModelConfig.gptj_6b, "gpt2-124m": ModelConfig.gpt2_124m,
           "opt-6.7b": ModelConfig.opt_6_7b, "smollm2-135m": ModelConfig.smollm2_135m}

# Sizes that make each family tiny; every other key of the hub's config is kept.  OPT keeps
# a projected embedding where the hub's has one (350m), and token ids fit the vocabulary.
TINY_SIZES = {
    "gpt2": dict(n_embd=32, n_head=4, n_layer=2, n_positions=64, n_ctx=64),
    "gptj": dict(n_embd=32, n_head=2, n_layer=2, n_positions=64, rotary_dim=8),
    "opt": dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, ffn_dim=48,
                max_position_embeddings=64),
    "llama": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                  intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64),
}
VOCAB = 101
IDS = np.array([[5, 17, 3, 99, 42, 7, 0, 64, 23, 11]], np.int32)


def hub(name: str) -> dict:
  with open(os.path.join(FIXTURES, name + ".json"), encoding="utf-8") as f:
    return json.load(f)


def tiny(raw: dict) -> dict:
  """The hub config with tiny sizes, every other key as published."""
  out = {**raw, **TINY_SIZES[raw["model_type"]], "vocab_size": VOCAB}
  if raw.get("word_embed_proj_dim", raw.get("hidden_size")) != raw.get("hidden_size"):
    out["word_embed_proj_dim"] = 16
  elif "word_embed_proj_dim" in raw:
    out["word_embed_proj_dim"] = out["hidden_size"]
  for key, value in (("bos_token_id", 0), ("eos_token_id", 0), ("pad_token_id", 1)):
    if key in raw:
      out[key] = value
  return out


def test_every_family_has_a_hub_config():
  assert {hub(n)["model_type"] for n in NAMES} == set(hf_config.TRANSLATORS)
  assert set(PRESETS) <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_the_hubs_config_translates(name):
  raw = hub(name)
  config = config_from_hf(raw, name=name)
  assert config.n_layers == raw.get("n_layer", raw.get("num_hidden_layers"))
  assert config.vocab_size == raw["vocab_size"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_is_what_its_hub_config_says(name):
  assert config_from_hf(hub(name), name=name) == PRESETS[name]()


@pytest.mark.parametrize("family", sorted(hf_config.TRANSFORMERS_IGNORES))
def test_keys_taken_as_ignored_are_ignored_by_transformers(family):
  """A key is accepted unread only where transformers' config class does not declare it and
  its modeling code never reads it: then transformers runs the model the same whatever it
  says.  A new transformers that starts reading one fails here."""
  import transformers
  config_cls = transformers.AutoConfig.for_model(family).__class__
  modeling = inspect.getsource(inspect.getmodule(
      transformers.AutoModelForCausalLM._model_mapping[config_cls]))
  declared = set()
  for cls in config_cls.__mro__:
    declared |= set(getattr(cls, "__annotations__", {}))
  for key in hf_config.TRANSFORMERS_IGNORES[family]:
    assert key not in declared, f"{config_cls.__name__} declares {key}"
    reads = re.compile(rf"config\.{re.escape(key)}\b|[\"']{re.escape(key)}[\"']")
    assert not reads.search(modeling), f"{family}'s modeling code reads {key}"


@pytest.mark.parametrize("name,key,value", [("gptj-6b", "rotary", False),
                                            ("gptj-6b", "scale_attn_weights", False),
                                            ("smollm2-135m", "rope_interleaved", True),
                                            ("gpt2-medium", "n_special", 2)])
def test_a_value_transformers_would_not_compute_is_refused_by_name(name, key, value):
  raw = {**hub(name), key: value}
  with pytest.raises(GSIError, match=rf"{key}={value!r} is not what transformers computes"):
    config_from_hf(raw)


@pytest.mark.parametrize("name", ["gptj-6b", "opt-6.7b", "smollm2-135m"])
def test_a_key_that_changes_the_model_is_refused_by_name(name):
  raw = {**hub(name), "sliding_window": 16}
  with pytest.raises(GSIError, match=r"does not know: \['sliding_window'\]"):
    config_from_hf(raw)


@pytest.mark.parametrize("name", NAMES)
def test_a_tiny_model_with_the_hubs_keys_matches_transformers(name, tmp_path):
  """save_pretrained writes its own config.json; it is replaced by the hub's keys (tiny
  sizes), so the loader reads what a download holds.  Both sides run in float32, whatever
  torch_dtype the hub's config names."""
  import torch
  import transformers
  raw = tiny(hub(name))
  torch.manual_seed(0)
  ref = transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.for_model(**copy.deepcopy(raw)), dtype=torch.float32)
  with torch.no_grad():
    for p in ref.parameters():
      p.add_(0.05 * torch.randn_like(p))
  ref.eval().save_pretrained(tmp_path)
  with open(tmp_path / "config.json", "w", encoding="utf-8") as f:
    json.dump(raw, f)
  model = gsi_jax.load_model(str(tmp_path))
  got = np.asarray(model.logits(model.params, IDS))
  with torch.no_grad():
    want = ref(torch.from_numpy(IDS).long()).logits.numpy()
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_a_wrong_key_in_a_hub_config_names_the_file(tmp_path):
  raw = {**tiny(hub("gptj-6b")), "rotary": False}
  (tmp_path / "config.json").write_text(json.dumps(raw))
  with pytest.raises(GSIError, match=r"config\.json: gptj config: rotary=False"):
    gsi_jax.load_model(str(tmp_path))
