"""Real model shapes (asyncrl.shapes) and the Qwen/Llama-style tokenizers
(asyncrl.chat_tokenizers): parameter counts of the released models, chat-template
layouts written out by hand, save/load round trips, and shallow models that load."""

from __future__ import annotations

import random
import unicodedata

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.chat_tokenizers import (
    FAMILIES,
    QWEN_DEFAULT_SYSTEM,
    build_bpe_tokenizer,
    save_tokenizer,
    small_tokenizer,
    tokenizer_corpus,
)
from asyncrl.models import ModelConfig, load_model, load_tokenizer
from asyncrl.random_models import build_shaped_model, random_init_model
from asyncrl.shapes import SHAPES, hf_config, meta_param_count

QUESTION = {"role": "user", "content": "What is 12 + 345?"}
ANSWER = {"role": "assistant", "content": "357"}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_real_shapes_have_the_released_parameter_counts(name):
    shape = SHAPES[name]
    config = hf_config(shape, small_tokenizer(shape.family))
    assert meta_param_count(config) == shape.params
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (shape.num_heads * shape.head_dim, shape.hidden_size)
    # Qwen2: bias on q/k/v; Qwen3: none, but per-head q/k norms; Llama: neither.
    assert (attention.q_proj.bias is not None) == (shape.model_type == "qwen2")
    assert hasattr(attention, "q_norm") == (shape.model_type == "qwen3")
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == shape.tie_word_embeddings


def test_depth_and_context_overrides_change_only_those():
    shape = SHAPES["llama3.2-1b"]
    config = hf_config(shape, small_tokenizer("llama"), num_layers=2, max_position_embeddings=4096)
    assert (config.num_hidden_layers, config.max_position_embeddings) == (2, 4096)
    assert config.vocab_size == shape.vocab_size and config.hidden_size == shape.hidden_size
    rope = getattr(config, "rope_parameters", None) or config.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0
    with pytest.raises(ValueError, match="vocab_rows"):
        hf_config(shape, small_tokenizer("llama"), vocab_rows=100)


def test_qwen_template_adds_default_system_and_no_bos():
    tok = small_tokenizer("qwen")
    text = tok.apply_chat_template([QUESTION], tokenize=False, add_generation_prompt=True)
    assert text == (
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 345?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    own = [{"role": "system", "content": "Be brief."}, QUESTION, ANSWER]
    text = tok.apply_chat_template(own, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 345?<|im_end|>\n"
        "<|im_start|>assistant\n357<|im_end|>\n"
    )
    ids = tok.apply_chat_template(own, tokenize=True, return_dict=False)
    assert list(ids) == tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.bos_token is None
    assert tok("hello")["input_ids"] == tok("hello", add_special_tokens=False)["input_ids"]


def test_llama_template_writes_bos_once_and_trims():
    tok = small_tokenizer("llama")
    turns = [{"role": "system", "content": " Be brief.\n"}, QUESTION]
    text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 12 + 345?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = list(tok.apply_chat_template(turns, add_generation_prompt=True, return_dict=False))
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    plain = tok("hello")["input_ids"]
    assert plain[0] == tok.bos_token_id
    assert plain[1:] == tok("hello", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_special_tokens_follow_the_trained_vocabulary(family):
    spec = FAMILIES[family]
    tok = small_tokenizer(family)
    first = len(tok) - len(spec.special_tokens)
    assert tok.convert_tokens_to_ids(list(spec.special_tokens)) == list(range(first, len(tok)))
    assert tok.eos_token == spec.eos_token and tok.pad_token == spec.pad_token
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.eos_token_id in tok.convert_tokens_to_ids(list(spec.stop_tokens))
    # Special tokens inside text are single ids, not spelled out.
    assert tok(spec.eos_token, add_special_tokens=False)["input_ids"] == [tok.eos_token_id]


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_save_and_load_keep_template_and_ids(family, tmp_path):
    built = build_bpe_tokenizer(family, tokenizer_corpus(100_000, seed=1), 800)
    save_tokenizer(built, tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)("12 apples") == loaded("12 apples")
    assert loaded.chat_template == built.chat_template == FAMILIES[family].chat_template
    assert loaded.get_vocab() == built.get_vocab()
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(loaded, attr) == getattr(built, attr)
    turns = [QUESTION, ANSWER]
    assert loaded.apply_chat_template(turns, return_dict=False) == built.apply_chat_template(
        turns, return_dict=False
    )
    assert loaded("12 apples")["input_ids"] == built("12 apples")["input_ids"]


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_random_text_round_trips(family):
    tok = small_tokenizer(family)
    rng = random.Random(0)
    alphabet = "abcXYZ 0123456789\n\t.,;'\"()+-*/=éü中文🤖\u0301"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        # Qwen normalises to NFC before splitting, as the real one does.
        expected = unicodedata.normalize("NFC", text) if family == "qwen" else text
        assert tok.decode(ids) == expected


def test_pre_tokenizers_split_digits_as_each_family_does():
    """Qwen cuts numbers into single digits, Llama-3 into runs of up to three; BPE merges
    never cross these pieces."""

    def pieces(family: str) -> list[str]:
        pre = small_tokenizer(family).backend_tokenizer.pre_tokenizer
        return [piece for piece, _ in pre.pre_tokenize_str("x=1234567")]

    assert pieces("qwen") == ["x", "=", "1", "2", "3", "4", "5", "6", "7"]
    assert pieces("llama") == ["x", "=", "123", "456", "7"]


@pytest.mark.parametrize(
    ("name", "layers", "dtype"),
    [("qwen2.5-0.5b", 2, "float32"), ("qwen3-0.6b", 1, "float32"), ("llama3.2-1b", 1, "bfloat16")],
)
def test_shallow_shaped_model_builds_and_loads(name, layers, dtype, tmp_path):
    shape = SHAPES[name]
    path = build_shaped_model(
        tmp_path / name,
        name,
        tokenizer_corpus(100_000),
        600,
        num_layers=layers,
        dtype=dtype,
        vocab_rows=1024,
    )
    assert not list(tmp_path.glob("*.tmp*"))
    model = load_model(ModelConfig(path=str(path)))
    tok = load_tokenizer(path)
    spec = FAMILIES[shape.family]
    assert model.config.num_hidden_layers == layers and model.config.vocab_size == 1024
    assert model.config.hidden_size == shape.hidden_size
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.bos_token_id == tok.convert_tokens_to_ids(spec.config_bos_token)
    stops = tok.convert_tokens_to_ids(list(spec.stop_tokens))
    assert model.generation_config.eos_token_id == stops
    assert model.generation_config.pad_token_id == tok.pad_token_id
    ids = tok.apply_chat_template([QUESTION], add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits
    assert logits.shape == (1, len(ids), 1024)
    assert torch.isfinite(logits).all()


def test_in_memory_model_equals_the_saved_one(tmp_path):
    """The meta-built model must be whole in memory: rotary buffers rebuilt, head tied,
    norms at one; the same seed gives the same weights."""
    config = hf_config(SHAPES["qwen3-0.6b"], small_tokenizer("qwen"), 1, vocab_rows=640)
    model = random_init_model(config, seed=3, dtype=torch.float32)
    again = random_init_model(config, seed=3, dtype=torch.float32)
    assert torch.equal(model.model.embed_tokens.weight, again.model.embed_tokens.weight)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert abs(model.model.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 1e-3
    assert torch.all(model.model.layers[0].self_attn.q_norm.weight == 1)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.arange(40).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, loaded(ids).logits)
