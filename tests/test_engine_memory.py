"""The embedded engine gives its memory back and takes it again (the colocated
placement's hybrid-engine pattern): nothing is held while released, and what it
generates after taking back the same weights is what it generated before."""

from __future__ import annotations

import pytest

from asyncrl.engine.base import Request, SamplingParams
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.models import ModelConfig, load_model

CFG = EmbeddedEngineConfig(max_slots=4, max_seq_len=48, device="cpu")


def _generate(engine: EmbeddedEngine, tag: str) -> list[tuple[list[int], list[float]]]:
    """Tokens and logprobs of six seeded, sampled completions through four slots."""
    prompts = [[5 + i, 9, 12 + i, 7] for i in range(6)]
    requests = [
        Request(f"{tag}-{i}", p, SamplingParams(max_new_tokens=10, seed=i))
        for i, p in enumerate(prompts)
    ]
    for request in requests:
        engine.submit(request)
    out: dict[str, tuple[list[int], list[float]]] = {r.request_id: ([], []) for r in requests}
    while not engine.idle:
        for t in engine.step().tokens:
            out[t.request_id][0].append(t.token_id)
            out[t.request_id][1].append(t.logprob)
    return [out[r.request_id] for r in requests]


def _weights(path: str) -> dict:
    return {k: v.clone() for k, v in load_model(ModelConfig(path=path)).state_dict().items()}


def test_released_engine_holds_nothing_and_generates_the_same_after(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir, CFG)
    try:
        before = _generate(engine, "a")
        loaded = engine.memory_bytes
        engine.release_memory()
        assert engine.cache is None and engine.memory_bytes == 0
        engine.submit(Request("x", [5, 6], SamplingParams(max_new_tokens=2)))
        with pytest.raises(RuntimeError, match="released"):
            engine.step()
        engine.abort("x")
        engine.step()  # reports the abort
        with pytest.raises(RuntimeError, match="load_weights"):
            engine.resume_memory()
        engine.load_weights(_weights(tiny_model_dir), version=1)
        engine.resume_memory()
        # One copy of the weights now: the idle one fills at the next staging.
        weights = sum(t.numel() * t.element_size() for t in _weights(tiny_model_dir).values())
        assert engine.memory_bytes < loaded
        assert engine.memory_bytes >= loaded - weights
        assert _generate(engine, "b") == before
    finally:
        engine.close()


def test_an_engine_started_released_generates_as_one_loaded_from_disk(tiny_model_dir):
    loaded = EmbeddedEngine(tiny_model_dir, CFG)
    released = EmbeddedEngine(tiny_model_dir, CFG, released=True)
    try:
        assert released.memory_bytes == 0
        released.load_weights(_weights(tiny_model_dir), version=0)
        released.resume_memory()
        assert _generate(released, "r") == _generate(loaded, "l")
    finally:
        loaded.close()
        released.close()


def test_release_refuses_while_sequences_run(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir, CFG)
    try:
        engine.submit(Request("r", [5, 6, 7], SamplingParams(max_new_tokens=8)))
        engine.step()
        with pytest.raises(RuntimeError, match="idle"):
            engine.release_memory()
    finally:
        engine.close()
