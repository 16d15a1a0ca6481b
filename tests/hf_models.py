"""Tiny random Hugging Face models of every family, saved to a folder."""

from __future__ import annotations

import torch
import transformers

# name -> (config class, kwargs).  Sizes are tiny but keep every switch the
# real checkpoints use: GQA, tied/untied heads, partial interleaved rotary,
# OPT's position offset, post-LN blocks and projected embeddings.
TINY = {
    "gpt2": (transformers.GPT2Config, dict(
        vocab_size=101, n_positions=64, n_embd=32, n_layer=2, n_head=4)),
    "gptj": (transformers.GPTJConfig, dict(
        vocab_size=101, n_positions=64, n_embd=32, n_layer=2, n_head=2, rotary_dim=8)),
    "opt": (transformers.OPTConfig, dict(
        vocab_size=101, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, ffn_dim=48, word_embed_proj_dim=32, pad_token_id=1)),
    "opt_post_ln": (transformers.OPTConfig, dict(
        vocab_size=101, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, ffn_dim=48, word_embed_proj_dim=16,
        do_layer_norm_before=False, pad_token_id=1)),
    "llama_mha": (transformers.LlamaConfig, dict(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=False)),
    "llama_gqa": (transformers.LlamaConfig, dict(
        vocab_size=101, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, rope_theta=100000.0)),
    "llama3_rope": (transformers.LlamaConfig, dict(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8))),
}


def build(name: str, seed: int = 0):
  config_cls, kwargs = TINY[name]
  torch.manual_seed(seed)
  config = config_cls(**{"bos_token_id": 0, "eos_token_id": 0, **kwargs})
  model = transformers.AutoModelForCausalLM.from_config(config)
  # Random init leaves norms at 1 / biases at 0; perturb so every copy matters.
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model.eval()


def save(name: str, folder, seed: int = 0, torch_bin: bool = False):
  """Save as safetensors (what save_pretrained writes) or as a pytorch_model.bin."""
  model = build(name, seed)
  if torch_bin:
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), f"{folder}/pytorch_model.bin")
  else:
    model.save_pretrained(folder)
  return model


def save_char_tokenizer(folder, vocab_size: int = 101):
  """A character-level tokenizer that fits the tiny vocabularies, so text flows end to end."""
  import string

  from tokenizers import Tokenizer, decoders, models
  chars = [c for c in string.printable if c not in "\x0b\x0c"][:vocab_size - 1]
  vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(chars)}}
  tok = Tokenizer(models.BPE(vocab, [], unk_token="[UNK]"))
  tok.decoder = decoders.Fuse()
  transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


if __name__ == "__main__":  # python -m tests.hf_models DIR: every tiny model, for GSI_JAX_TINY_MODELS
  import os
  import sys
  for name in TINY:
    folder = os.path.join(sys.argv[1], name)
    save(name, folder)
    save_char_tokenizer(folder)
