"""The embedded engine against transformers and against the trainer: logits, greedy
generation, behavior logprobs, weight flips, abort, and no leaks.

Why one file: the embedded engine's equivalences (logits, greedy tokens, logprobs, flips,
seeded draws against transformers and the trainer) share the models and engines built once
at the top.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from asyncrl.engine.base import Request, SamplingParams
from asyncrl.engine.decoder import CachedDecoder, KVCache
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.engine.weight_dirs import write_weights_dir
from asyncrl.logprobs import token_logprobs
from asyncrl.models import ModelConfig, load_model, load_tokenizer, model_config
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.dist import init_distributed
from asyncrl.trainer.packing import TokenSequence, make_micro_batches


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tiny_model_dir):
    """A random Llama with another head layout: full multi-head attention, head_dim 24
    (not hidden / heads), no attention bias, a different rope base."""
    vocab = load_model(ModelConfig(path=tiny_model_dir)).config.vocab_size
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=24,
        max_position_embeddings=128,
        rope_theta=500.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("llama") / "llama"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    load_tokenizer(tiny_model_dir).save_pretrained(path)
    return str(path)


def collect(out, tokens: dict, finished: dict) -> None:
    for t in out.tokens:
        tokens.setdefault(t.request_id, []).append(t)
    for f in out.finished:
        assert f.request_id not in finished, f"{f.request_id} finished twice"
        finished[f.request_id] = f


def run_all(engine: EmbeddedEngine, tokens=None, finished=None, max_steps: int = 10_000):
    """Step until idle; returns {request_id: [GeneratedToken]} and {request_id: Finished}."""
    tokens = {} if tokens is None else tokens
    finished = {} if finished is None else finished
    for _ in range(max_steps):
        if engine.idle:
            break
        collect(engine.step(), tokens, finished)
    return tokens, finished


def wait_staged(engine: EmbeddedEngine, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while engine.status().staged_version == -1:
        assert time.time() < deadline, "weights were never staged"
        time.sleep(0.005)


def random_sequences(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 30))] for _ in range(n)]


@pytest.mark.parametrize("which", ["qwen2", "llama"])
def test_logits_equal_transformers(which, tiny_model_dir, llama_dir):
    path = tiny_model_dir if which == "qwen2" else llama_dir
    # The engine's decoder over its slot cache (4 slots of 64 positions).
    decoder = CachedDecoder(load_model(ModelConfig(path=path)).eval())
    cache = KVCache.allocate(decoder.model, 4, 64)
    hf = load_model(ModelConfig(path=path)).eval()
    seqs = random_sequences(hf.config.vocab_size, 3, seed=7)
    split = [len(s) // 2 for s in seqs]
    with torch.no_grad():
        refs = [hf(torch.tensor([s]), use_cache=False).logits[0] for s in seqs]
        # Prefill the first halves together (padded batch), then decode the rest together.
        pre = decoder.prefill(cache, 1, [s[:k] for s, k in zip(seqs, split)], all_logits=True)
        ours = [[pre[i, : split[i]]] for i in range(3)]
        for t in range(max(len(s) for s in seqs)):
            if all(split[i] + t >= len(seqs[i]) for i in range(3)):
                break
            # A finished sequence re-decodes its last token at its last position (same
            # K/V again) so the three slots stay one contiguous range.
            pos = [min(split[i] + t, len(seqs[i]) - 1) for i in range(3)]
            logits = decoder.decode(cache, 1, [seqs[i][p] for i, p in enumerate(pos)], pos)
            for i in range(3):
                if split[i] + t < len(seqs[i]):
                    ours[i].append(logits[i : i + 1])
    for i in range(3):
        diff = (torch.cat(ours[i]) - refs[i]).abs().max().item()
        assert diff <= 1e-4, (which, i, diff)


def test_greedy_generation_equals_transformers_generate(tiny_model_dir, llama_dir):
    for path in (tiny_model_dir, llama_dir):
        engine = EmbeddedEngine(path, EmbeddedEngineConfig(max_slots=3, max_seq_len=64))
        hf = load_model(ModelConfig(path=path)).eval()
        prompts = random_sequences(hf.config.vocab_size, 5, seed=11)
        for i, p in enumerate(prompts):  # 5 requests through 3 slots: joins and leaves
            engine.submit(Request(str(i), p, SamplingParams(max_new_tokens=12, temperature=0.0)))
        tokens, finished = run_all(engine)
        for i, p in enumerate(prompts):
            ref = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=12,
                eos_token_id=hf.config.eos_token_id,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            assert [t.token_id for t in tokens[str(i)]] == ref, (path, i)
            assert finished[str(i)].num_tokens == len(ref)
        engine.close()


@pytest.fixture(scope="module")
def trainer_core(tmp_path_factory, tiny_model_dir):
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    info = init_distributed("cpu", str(tmp_path_factory.mktemp("rdv") / "rendezvous"))
    return TrainerCore(
        ModelConfig(path=tiny_model_dir), TrainerConfig(), OptimConfig(), info, pad_id=0
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_equal_trainer_recompute(tiny_model_dir, trainer_core, temperature):
    """The engine's behavior logprobs equal what the FSDP2 trainer recomputes for the same
    tokens and weights, through the trainer's own packed forward pass."""
    engine = EmbeddedEngine(tiny_model_dir, EmbeddedEngineConfig(max_slots=4, max_seq_len=64))
    prompts = random_sequences(model_config(tiny_model_dir).vocab_size, 4, seed=5)
    for i, p in enumerate(prompts):
        params = SamplingParams(max_new_tokens=10, temperature=temperature, top_k=20, seed=i)
        engine.submit(Request(str(i), p, params))
    tokens, _ = run_all(engine)
    seqs = [
        TokenSequence(
            p + [t.token_id for t in tokens[str(i)]], [0] * len(p) + [1] * len(tokens[str(i)])
        )
        for i, p in enumerate(prompts)
    ]
    (mb,) = make_micro_batches(seqs, budget=1024, row_tokens=1024)  # one packed row
    with torch.no_grad():
        recomputed = token_logprobs(trainer_core.forward(mb), mb.input_ids, temperature)[
            mb.loss_mask.bool()
        ]
    behavior = torch.tensor([t.logprob for i in range(4) for t in tokens[str(i)]])
    assert behavior.shape == recomputed.shape
    torch.testing.assert_close(behavior, recomputed, atol=1e-4, rtol=0)
    engine.close()


def _perturbed(path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    model = load_model(ModelConfig(path=path))
    return {k: v + 0.5 * v.std() * torch.randn_like(v) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_flip_mid_request_versions_and_recompute(tiny_model_dir, policy):
    engine = EmbeddedEngine(
        tiny_model_dir, EmbeddedEngineConfig(max_slots=2, max_seq_len=64, flip_policy=policy)
    )
    vocab = model_config(tiny_model_dir).vocab_size
    prompt = random_sequences(vocab, 1, seed=2)[0]
    # A stop token outside the vocabulary: generation runs to max_new_tokens.
    engine.eos_ids = set()
    engine.submit(Request("r", prompt, SamplingParams(max_new_tokens=16, temperature=0.0)))
    tokens = []
    for _ in range(5):
        tokens += engine.step().tokens
    new_weights = _perturbed(tiny_model_dir)
    engine.stage_weights(new_weights, version=1)
    wait_staged(engine)
    while engine.running:
        tokens += engine.step().tokens
    assert [t.version for t in tokens] == [0] * 5 + [1] * 11
    if policy == "recompute":
        fresh = load_model(ModelConfig(path=tiny_model_dir)).eval()
        fresh.load_state_dict(new_weights)
        # A fresh greedy generation (full forward each step, EOS not special) from the
        # prompt plus the tokens generated before the flip.
        ids = prompt + [t.token_id for t in tokens[:5]]
        with torch.no_grad():
            for _ in range(11):
                ids.append(int(fresh(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        assert [t.token_id for t in tokens[5:]] == ids[-11:]
        assert engine.counters.recomputed_tokens == len(prompt) + 4
    engine.close()


def test_weights_from_a_directory_flip_in_when_waited_for(tiny_model_dir, tmp_path):
    """``stage_weights`` takes an HF directory as it takes tensors; with ``wait`` the next
    step already generates with it: the greedy tokens of an engine started from it."""
    weights = write_weights_dir(_perturbed(tiny_model_dir), tiny_model_dir, tmp_path / "v1")
    cfg = EmbeddedEngineConfig(max_slots=2, max_seq_len=64)
    engine, fresh = EmbeddedEngine(tiny_model_dir, cfg), EmbeddedEngine(str(weights), cfg)
    engine.stage_weights(str(weights), version=1, wait=True)
    status = engine.status()
    assert status.version == 1 and status.staged_version == -1
    got, want = {}, {}
    for e, tokens in ((engine, got), (fresh, want)):
        e.submit(Request("r", [3, 4, 5], SamplingParams(max_new_tokens=8, temperature=0.0)))
        run_all(e, tokens)
        e.close()
    assert [t.version for t in got["r"]] == [1] * len(want["r"])
    assert [t.token_id for t in got["r"]] == [t.token_id for t in want["r"]]


def test_abort_frees_the_slot_and_admits_the_next(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir, EmbeddedEngineConfig(max_slots=2, max_seq_len=64))
    engine.eos_ids = set()
    for i in range(3):
        engine.submit(
            Request(str(i), [5, 6, 7], SamplingParams(max_new_tokens=30, temperature=0.0))
        )
    engine.step()
    assert set(engine.running) == {"0", "1"} and engine.free_slots == 0
    engine.abort("0")
    assert engine.free_slots == 1 and engine.slots[0].request.request_id == "1"
    out = engine.step()
    assert [(f.request_id, f.reason) for f in out.finished] == [("0", "abort")]
    assert "0" not in {t.request_id for t in out.tokens}
    assert set(engine.running) == {"1", "2"}  # the waiting request took the slot
    engine.abort("2")
    engine.abort("1")
    engine.step()
    assert engine.free_slots == 2 and not engine.running
    engine.close()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_thousand_random_requests_leave_no_leak(tiny_model_dir):
    engine = EmbeddedEngine(
        tiny_model_dir, EmbeddedEngineConfig(max_slots=16, max_seq_len=64, max_prefill_tokens=256)
    )
    vocab = model_config(tiny_model_dir).vocab_size
    cache_ptr = engine.cache.k.data_ptr()
    rss = []
    for round_ in range(2):  # the second round must not grow memory
        rng = random.Random(round_)
        expected, aborted, tokens, finished = {}, set(), {}, {}
        for i in range(1000):
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
            expected[str(i)] = rng.randint(1, 20)
            engine.submit(
                Request(str(i), prompt, SamplingParams(max_new_tokens=expected[str(i)], seed=i))
            )
            if i % 7 == 0:
                collect(engine.step(), tokens, finished)
            if i % 50 == 3 and str(i) not in finished:
                engine.abort(str(i))  # queued or running, whichever it is now
                aborted.add(str(i))
        run_all(engine, tokens, finished)
        assert set(finished) == set(expected)  # every request ended, exactly once
        for rid, n in expected.items():
            got = len(tokens.get(rid, []))
            if rid in aborted:
                assert finished[rid].reason == "abort" and got == finished[rid].num_tokens <= n
                continue
            assert got == finished[rid].num_tokens
            assert got == n if finished[rid].reason == "length" else got <= n
        assert engine.idle
        assert engine.free_slots == 16 and not engine.slots
        assert engine.cache.k.data_ptr() == cache_ptr  # preallocated once, reused
        rss.append(_rss_mb())
    assert engine.counters.finished + engine.counters.aborted == 2000
    assert rss[1] - rss[0] < 30, rss
    engine.close()


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model_dir):
    def generate(batch_mates: int) -> list[int]:
        engine = EmbeddedEngine(tiny_model_dir, EmbeddedEngineConfig(max_slots=8, max_seq_len=64))
        engine.submit(
            Request("me", [4, 5, 6], SamplingParams(max_new_tokens=12, temperature=1.0, seed=123))
        )
        for j in range(batch_mates):
            engine.submit(
                Request(f"o{j}", [7] * (j + 2), SamplingParams(max_new_tokens=12, temperature=1.0))
            )
        tokens, _ = run_all(engine)
        engine.close()
        return [t.token_id for t in tokens["me"]]

    assert generate(0) == generate(5)


def test_sampling_follows_the_scaled_truncated_distribution():
    """20,000 draws from one row of logits: frequencies match softmax(logits / T), and
    top-k / top-p renormalize over the kept tokens (tolerance 0.015, about 4 sigma)."""
    from asyncrl.engine.sampling import sample

    torch.manual_seed(0)
    row = torch.tensor([2.0, 1.0, 0.0, -1.0, 3.0])
    logits = row.repeat(20_000, 1)

    def freqs(seeded: bool, **kw) -> torch.Tensor:
        # Seeded rows (each its own seed) invert the CDF; unseeded rows take Gumbel-max.
        params = [SamplingParams(seed=i if seeded else None, **kw) for i in range(len(logits))]
        tokens, _ = sample(logits, params, [7] * len(logits))
        return torch.bincount(torch.tensor(tokens), minlength=5).float() / len(logits)

    top2 = torch.zeros(5)
    top2[[0, 4]] = row[[0, 4]].softmax(-1)
    for seeded in (False, True):
        for temperature in (1.0, 0.5):
            expected = (row / temperature).softmax(-1)
            assert torch.allclose(freqs(seeded, temperature=temperature), expected, atol=0.015)
        assert torch.allclose(freqs(seeded, top_k=2), top2, atol=0.015)
        # top_p = 0.8: tokens 4 (0.64) and 0 (0.23) reach it; the rest are cut.
        assert torch.allclose(freqs(seeded, top_p=0.8), top2, atol=0.015)


def test_a_seeded_sample_resumed_from_its_prefix_draws_what_it_would_have(tiny_model_dir):
    """A seeded request's draw at position t depends on (seed, t) only: resumed as prompt
    plus its first tokens (a lease moved to another generator), in another engine, it
    goes on with the tokens it would have generated."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=2026)

    def generate(prompt: list[int], max_new_tokens: int) -> list[int]:
        engine = EmbeddedEngine(tiny_model_dir)
        engine.submit(Request("r", prompt, replace(params, max_new_tokens=max_new_tokens)))
        tokens, _ = run_all(engine)
        engine.close()
        return [t.token_id for t in tokens["r"]]

    whole = generate([4, 5, 6], 12)
    assert len(whole) == 12
    assert generate([4, 5, 6, *whole[:5]], 7) == whole[5:]
    assert generate([4, 5, 6], 12) == whole


def test_shared_prefill_equals_prefilling_each(tiny_model_dir):
    """A GRPO group's samples share one prompt: with ``share_prefill`` it is prefilled
    once per step and copied. Seeded per request, every request must get the same tokens
    and (to float noise) the same logprobs as when each is prefilled on its own, with
    groups split across steps by the slot limit and repeats of resumed prefixes too."""
    rng = random.Random(3)
    vocab = load_model(ModelConfig(path=tiny_model_dir)).config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 20))] for _ in range(12)]
    requests = []
    for p, prompt in enumerate(prompts):
        # 1 to 5 samples of one prompt, some resumed with a partial completion (a reissued
        # lease), which is shared only with an identical one
        prefix = [rng.randrange(3, vocab) for _ in range(3)] if p % 4 == 3 else []
        for j in range(rng.randint(1, 5)):
            params = SamplingParams(
                max_new_tokens=rng.randint(1, 9), temperature=1.0, seed=100 * p + j
            )
            requests.append(Request(f"{p}-{j}", prompt + prefix, params))

    def generate(share: bool):
        engine = EmbeddedEngine(
            tiny_model_dir, EmbeddedEngineConfig(max_slots=6, max_seq_len=64, share_prefill=share)
        )
        engine.eos_ids = set()
        for r in requests:
            engine.submit(r)
        tokens, finished = run_all(engine)
        stats = engine.status().metrics
        engine.close()
        return tokens, finished, stats

    shared, shared_done, stats = generate(True)
    each, each_done, each_stats = generate(False)
    assert set(shared) == set(each) == {r.request_id for r in requests}
    for rid in each:
        assert [t.token_id for t in shared[rid]] == [t.token_id for t in each[rid]], rid
        assert torch.allclose(
            torch.tensor([t.logprob for t in shared[rid]]),
            torch.tensor([t.logprob for t in each[rid]]),
            atol=1e-5,
        ), rid
        assert shared_done[rid].num_tokens == each_done[rid].num_tokens
    assert (
        stats["engine/shared_prefill_tokens"] > 0
        and each_stats["engine/shared_prefill_tokens"] == 0
    )
    # Every prompt token is either prefilled or copied, never both.
    assert (
        stats["engine/prefill_tokens"] + stats["engine/shared_prefill_tokens"]
        == each_stats["engine/prefill_tokens"]
    )
