"""Prompt rendering (``asyncrl.tasks.prompts``) with a Qwen-style and a Llama-style
tokenizer built here: the chat template's layout, BOS once, completions through the end
of turn, and the tokens a trained sample carries equal to the engine's prompt and output."""

from __future__ import annotations

from dataclasses import replace

import pytest

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.scoring import InlineScoring
from asyncrl.chat_tokenizers import QWEN_DEFAULT_SYSTEM, small_tokenizer
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.engine.leases import PendingLease, lease_request, record_tokens
from asyncrl.models import load_tokenizer
from asyncrl.tasks import Example, TaskConfig, build_task
from asyncrl.tasks.prompts import PromptRenderer
from asyncrl.tasks.stream import TaskPrompts
from asyncrl.wire import Chunk, SamplingSpec

QUESTION = "What is 12 + 30?"
EXAMPLE = Example(uid="train:0", prompt=QUESTION, answer="42", completion=" 42")


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_chat_rendering_is_the_tokenizers_template(family):
    tokenizer = small_tokenizer(family)
    renderer = PromptRenderer(tokenizer, "chat", system_prompt="Be brief.")
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    ids = renderer.prompt_ids(EXAMPLE)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = {
        "qwen": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n",
        "llama": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        f"{QUESTION}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    }[family]
    assert _decode(tokenizer, ids) == expected
    assert ids.count(tokenizer.bos_token_id) == (1 if family == "llama" else 0)


def test_without_a_system_prompt_the_template_decides_and_a_rows_own_wins():
    tokenizer = small_tokenizer("qwen")
    plain = _decode(tokenizer, PromptRenderer(tokenizer, "chat").prompt_ids(EXAMPLE))
    assert plain.startswith(f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>")
    own = replace(
        EXAMPLE,
        messages=(
            {"role": "system", "content": "Row's own."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": QUESTION},
        ),
    )
    text = _decode(tokenizer, PromptRenderer(tokenizer, "chat", "Config's.").prompt_ids(own))
    assert "Config's." not in text and text.count("<|im_start|>") == 5
    assert text.startswith("<|im_start|>system\nRow's own.<|im_end|>\n<|im_start|>user\nHi")


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_a_completion_is_the_assistant_turn_through_its_end_token(family):
    tokenizer = small_tokenizer(family)
    renderer = PromptRenderer(tokenizer, "chat")
    prompt = renderer.prompt_ids(EXAMPLE)
    completion = renderer.completion_ids(EXAMPLE, "The answer is 42.")
    turns = [*renderer.messages(EXAMPLE), {"role": "assistant", "content": "The answer is 42."}]
    full = tokenizer.apply_chat_template(turns, tokenize=False)
    whole = tokenizer(full, add_special_tokens=False)["input_ids"]
    end = tokenizer.eos_token_id
    assert end == tokenizer.convert_tokens_to_ids(
        {"qwen": "<|im_end|>", "llama": "<|eot_id|>"}[family]
    )
    # Prompt + completion are the template's conversation up to and with the end of turn.
    assert prompt + completion == whole[: whole.index(end, len(prompt)) + 1]
    assert completion.count(end) == 1 and completion[-1] == end
    assert tokenizer.decode(completion, skip_special_tokens=True).strip() == "The answer is 42."


def test_plain_prompts_get_the_bos_their_tokenizer_adds():
    llama, qwen = small_tokenizer("llama"), small_tokenizer("qwen")
    ids = PromptRenderer(llama).prompt_ids(EXAMPLE)
    assert ids[0] == llama.bos_token_id and ids.count(llama.bos_token_id) == 1
    assert ids[1:] == llama(QUESTION, add_special_tokens=False)["input_ids"]
    assert PromptRenderer(qwen).prompt_ids(EXAMPLE) == qwen(QUESTION)["input_ids"]
    completion = PromptRenderer(qwen).completion_ids(EXAMPLE, " 42")
    assert completion == qwen(" 42", add_special_tokens=False)["input_ids"] + [qwen.eos_token_id]


def test_chat_needs_a_template():
    tokenizer = small_tokenizer("qwen")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template.*task.prompt_format=plain"):
        PromptRenderer(tokenizer, "chat")


def test_a_trained_sample_is_the_engines_prompt_and_completion_exactly(chat_model_dir):
    """Chat-rendered prompts go from the buffer's prompt stream through a lease to the
    engine; the sample the trainer gets holds exactly those prompt ids and the engine's
    tokens (no re-tokenization anywhere), with the loss on the completion only."""
    task_cfg = TaskConfig(train_size=50, prompt_format="chat", system_prompt="Add.")
    task = build_task(task_cfg)
    prompts = TaskPrompts(task, chat_model_dir, seed=0)
    cfg = BufferConfig(prompts_per_batch=2, samples_per_prompt=2, max_staleness=None)
    buffer = RolloutBuffer(cfg, "run", prompts, SamplingSpec(max_new_tokens=6, seed=1))
    engine = EmbeddedEngine(chat_model_dir, EmbeddedEngineConfig(max_slots=4, max_seq_len=256))
    pending = {}
    for lease in buffer.leases.lease("g", 4, 0.0):
        engine.submit(lease_request(lease))
        pending[lease.lease_id] = PendingLease(lease)
    generated: dict[tuple[int, int], list[int]] = {}
    while pending:
        for p, reason in record_tokens(pending, engine.step()):
            generated[(p.lease.group_id, p.lease.sample_index)] = list(p.token_ids)
            chunk = Chunk(
                run_id="run",
                worker_id="g",
                lease_id=p.lease.lease_id,
                seq=0,
                token_ids=p.token_ids,
                logprobs=p.logprobs,
                versions=p.versions,
                finished=True,
                finish_reason=reason,
            )
            buffer.leases.on_chunk(chunk, 0.0)
    InlineScoring(lambda prompt_id, completion, reason: float(len(completion) % 2)).pump(buffer)
    samples = buffer.batches.batch_for(1, 0, 1)
    assert len(samples) == 4
    renderer = PromptRenderer.for_task(task_cfg, load_tokenizer(chat_model_dir))
    for s in samples:
        prompt = renderer.prompt_ids(task.examples("train")[s.prompt_id])
        assert prompt[-3:] == renderer.prompt_ids(EXAMPLE)[-3:]  # "<|im_start|>assistant\n"
        completion = generated[(s.group_id, s.sample_index)]
        assert s.token_ids == prompt + completion
        assert s.loss_mask == [0] * len(prompt) + [1] * len(completion)
    engine.close()
