from __future__ import annotations

import torch

from asyncrl.models import ModelConfig, build_char_tokenizer, load_model, load_tokenizer


def test_char_tokenizer_roundtrip_and_unknown_chars():
    tok = build_char_tokenizer(["Calculate 12 + 3."])
    text = "Calculate 45 + 7."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok("Calculate #", add_special_tokens=False)["input_ids"][-1] == tok.unk_token_id


def test_tiny_model_loads_through_the_hf_path(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    model = load_model(ModelConfig(path=tiny_model_dir))
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tok)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.tensor([tok("Calculate 1 + 2.")["input_ids"]])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))
    again = load_model(ModelConfig(path=tiny_model_dir))
    torch.testing.assert_close(again(ids).logits, model(ids).logits)  # same weights on disk


def test_missing_model_dir_says_how_to_make_one(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="make_tiny_model"):
        load_model(ModelConfig(path=str(tmp_path / "nope")))
