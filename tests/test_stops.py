"""Stop strings and stop token ids (``asyncrl.engine.stops``): where the text is cut, the
incremental check against decoding every prefix whole, the embedded engine ending a
request at exactly the token that completes a stop string, the config's way to the
engine (``SamplingSpec`` on the wire, ``lease_request``), the buffer's scoring text and
evaluation. The remote engine and the sglang front are tested in their own files."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncrl.buffer.config import RolloutConfig
from asyncrl.buffer.rewards import RewardConfig
from asyncrl.buffer.scoring import Scoring
from asyncrl.engine.base import Request, SamplingParams
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.engine.leases import SamplingConfig, lease_request
from asyncrl.engine.stops import StopChecker, text_until_stop, trim_at_stop
from asyncrl.evaluation import greedy_accuracy, greedy_generate
from asyncrl.models import ModelConfig, load_tokenizer
from asyncrl.wire import Lease, SamplingSpec, WireDecoder, encode

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 3], [12, 13, 14, 15], [4, 4, 4, 4, 4, 4], [9]]


def first_stop(tokenizer, ids: list[int], stop: list[str]) -> int | None:
    """The reference: the length of the shortest prefix of ``ids`` whose whole decoded text
    holds a stop string (None: no prefix does)."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if any(s and s in text for s in stop):
            return k
    return None


# ---- cutting the text ----------------------------------------------------------------------
def test_trim_cuts_before_or_after_the_first_stop_string():
    assert trim_at_stop("x = 4\n\nnext", ["\n\n"], keep=False) == ("x = 4", "\n\n")
    assert trim_at_stop("x = 4\n\nnext", ["\n\n"], keep=True) == ("x = 4\n\n", "\n\n")
    # The string that starts first wins, whatever the list order; the longest at a tie.
    assert trim_at_stop("a;b.c", [".", ";"], keep=False) == ("a", ";")
    assert trim_at_stop("ab\n\nc", ["\n", "\n\n"], keep=True) == ("ab\n\n", "\n\n")
    assert trim_at_stop("abc", ["x", ""], keep=False) == ("abc", None)  # "" is ignored
    assert trim_at_stop("end.", ["."], keep=False) == ("end", ".")


def test_text_until_stop_drops_a_final_stop_token_unless_kept():
    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    ids = [0, 1, 7]  # "abh", 7 a stop token
    assert text_until_stop(decode, ids, [], [7], keep=False) == "ab"
    assert text_until_stop(decode, ids, [], [7], keep=True) == "abh"
    assert text_until_stop(decode, [0, 7, 1], [], [7], keep=False) == "ahb"  # not final
    assert text_until_stop(decode, [0, 1, 2, 3], ["bc"], [], keep=False) == "a"
    assert text_until_stop(decode, [0, 1, 2, 3], ["bc"], [], keep=True) == "abc"


# ---- the incremental check -----------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_tokenizer_dir(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer (GPT-2's byte alphabet) with a few merges: multi-byte
    characters span tokens, and some tokens hold several characters."""
    vocab = {"<eos>": 0}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [("a", "b"), ("ab", "c"), ("Ã", "©"), ("Ċ", "Ċ")]  # é, "\n\n"
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    path = tmp_path_factory.mktemp("bytes")
    tokenizer.save_pretrained(path)
    return str(path)


def first_checked(checker: StopChecker, ids: list[int], stop: list[str]) -> int | None:
    """Feed ``ids`` one token at a time, as the engine does; where the checker stops."""
    for k in range(1, len(ids) + 1):
        if checker.matched(ids[:k], k, stop) is not None:
            return k
    return None


def test_a_stop_string_of_multibyte_characters_ends_at_its_last_byte(byte_tokenizer_dir):
    tokenizer = load_tokenizer(byte_tokenizer_dir)
    checker = StopChecker(byte_tokenizer_dir)
    ids = tokenizer.encode("xé€y€")  # é one token, € three byte tokens
    assert first_checked(checker, ids, ["€"]) == 5  # x, é, and the euro's three bytes
    assert first_checked(checker, ids, ["é€y"]) == 6
    assert first_checked(checker, ids, ["z"]) is None
    # Skipped special tokens inside the string do not hide it.
    with_eos = ids[:3] + [tokenizer.eos_token_id] + ids[3:]
    assert first_checked(checker, with_eos, ["€"]) == 6


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_tail_check_stops_where_decoding_every_prefix_would(byte_tokenizer_dir, data):
    tokenizer = load_tokenizer(byte_tokenizer_dir)
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.integers(1, vocab - 1), min_size=1, max_size=40))
    for _ in range(data.draw(st.integers(0, 3))):  # a few skipped special tokens
        ids.insert(data.draw(st.integers(0, len(ids))), tokenizer.eos_token_id)
    text = tokenizer.decode(ids, skip_special_tokens=True).replace("\ufffd", "")
    stop = []
    for _ in range(data.draw(st.integers(1, 3))):
        start = data.draw(st.integers(0, max(len(text) - 1, 0)))
        stop.append(text[start : start + data.draw(st.integers(1, 6))] or "q")
    checker = StopChecker(byte_tokenizer_dir)
    assert first_checked(checker, ids, stop) == first_stop(tokenizer, ids, stop)


# ---- the embedded engine -------------------------------------------------------------------
def drain(engine: EmbeddedEngine, requests: list[Request]) -> tuple[dict, dict]:
    """Run ``requests`` to the end: ({id: token ids}, {id: Finished})."""
    for r in requests:
        engine.submit(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finished: dict = {}
    while len(finished) < len(requests):
        out = engine.step()
        for t in out.tokens:
            tokens[t.request_id].append(t.token_id)
        finished.update((f.request_id, f) for f in out.finished)
    return tokens, finished


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir, EmbeddedEngineConfig(max_slots=8, threads=1))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def free_runs(engine) -> dict[str, list[int]]:
    """Greedy completions with no stop, 16 tokens each, by request id."""
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    tokens, _ = drain(engine, [Request(f"free{i}", p, params) for i, p in enumerate(PROMPTS)])
    return tokens


def two_char_stops(tokenizer, free_runs: dict[str, list[int]]) -> dict[str, str]:
    """For each long enough free completion, the two characters its tokens 4 and 5 decode
    to: a stop string spanning two tokens of the char tokenizer (it may occur earlier)."""
    stops = {}
    for rid, ids in free_runs.items():
        text = tokenizer.decode(ids[:6], skip_special_tokens=True)
        if tokenizer.eos_token_id not in ids[:6] and len(text) == 6:
            stops[rid] = text[4:6]
    assert len(stops) >= 3, free_runs  # enough prompts run past 6 tokens
    return stops


def test_a_stop_string_ends_generation_at_its_first_token(engine, free_runs, tiny_model_dir):
    """Batched with requests that have no stop (they run on as before), each request with
    a stop string gets the free run's tokens up to the first whose prefix holds the string,
    that token included, and finishes ``stop`` with the string matched."""
    tokenizer = load_tokenizer(tiny_model_dir)
    stops = two_char_stops(tokenizer, free_runs)
    requests = [
        Request(
            f"cut-{rid}",
            PROMPTS[int(rid[4:])],
            SamplingParams(max_new_tokens=16, temperature=0.0, stop=["never there", s]),
        )
        for rid, s in stops.items()
    ] + [Request("plain", PROMPTS[0], SamplingParams(max_new_tokens=16, temperature=0.0))]
    tokens, finished = drain(engine, requests)
    for rid, stop in stops.items():
        cut = first_stop(tokenizer, free_runs[rid], [stop])
        assert cut is not None and cut <= 6
        assert tokens[f"cut-{rid}"] == free_runs[rid][:cut]
        done = finished[f"cut-{rid}"]
        assert (done.reason, done.matched, done.num_tokens) == ("stop", stop, cut)
    assert tokens["plain"] == free_runs["free0"]
    assert finished["plain"].matched is None


def test_stop_token_ids_end_generation_with_no_string(engine, free_runs):
    ids = free_runs["free1"]
    stop_at = ids[3]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[stop_at])
    tokens, finished = drain(engine, [Request("tok", PROMPTS[1], params)])
    cut = ids.index(stop_at) + 1
    assert tokens["tok"] == ids[:cut]
    done = finished["tok"]
    assert (done.reason, done.matched, done.num_tokens) == ("stop", None, cut)


# ---- from the config to the engine, and the text scored ------------------------------------
def test_sampling_config_reaches_the_engine_request_through_the_wire():
    sampling = SamplingConfig(max_new_tokens=9, stop=["\n\n", "END"], stop_token_ids=[7])
    lease = Lease(
        run_id="r",
        lease_id="l1",
        prompt_id=0,
        group_id=0,
        sample_index=0,
        prompt_ids=[1, 2],
        sampling=sampling.spec(),
        prefix_ids=[5],
    )
    decoded = WireDecoder("r").decode(encode(lease))
    assert decoded == lease
    params = lease_request(decoded).params
    assert params.stop == ["\n\n", "END"] and params.stop_token_ids == [7]
    assert params.max_new_tokens == 8
    # A message from before stop strings existed decodes with none.
    old = msgspec.json.decode(b'{"max_new_tokens": 5, "stop_token_ids": [3]}', type=SamplingSpec)
    assert old.stop == [] and old.stop_token_ids == [3]
    assert b"stop" not in msgspec.json.encode(SamplingSpec())  # defaults stay off the wire


def test_scoring_reads_the_completion_cut_at_its_stop(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    plus = tokenizer.encode("+")[0]
    with_eos = tokenizer.encode("12 + 3. 15") + [tokenizer.eos_token_id]
    at_token = tokenizer.encode("12 +")
    cases = [  # (sampling, completion, the verifier's text)
        (SamplingConfig(), with_eos, "12 + 3. 15"),
        (SamplingConfig(stop=[". "]), with_eos, "12 + 3"),
        (SamplingConfig(stop=[". "], keep_stop_text=True), with_eos, "12 + 3. "),
        (SamplingConfig(stop_token_ids=[plus]), at_token, "12 "),
        (SamplingConfig(stop_token_ids=[plus], keep_stop_text=True), at_token, "12 +"),
        (SamplingConfig(stop_token_ids=[plus]), with_eos, "12 + 3. 15"),  # not at its end
    ]
    for sampling, completion, text in cases:
        cfg = RolloutConfig(
            model=ModelConfig(path=tiny_model_dir),
            sampling=sampling,
            reward=RewardConfig(workers=0),
        )
        scoring = Scoring(cfg)
        try:
            assert scoring.text(completion) == text, sampling
        finally:
            scoring.close()


def test_evaluation_stops_and_scores_the_cut_text(engine, tiny_model_dir, task):
    """Greedy evaluation with a stop string: each completion's scored text is the free
    run's text cut at it (before it, or after it with ``keep_stop_text``), and fewer
    tokens are generated."""
    tokenizer = load_tokenizer(tiny_model_dir)
    examples = list(task.examples("eval"))[:4]
    scored: list[str] = []

    def score(example, text: str) -> float:
        scored.append(text)
        return 1.0

    recorder = SimpleNamespace(config=task.config, score=score)
    free = greedy_accuracy(engine, tokenizer, recorder, examples, 12)
    free_texts = list(scored)
    stop = next(t[2:4] for t in free_texts if len(t) >= 4)
    for keep in (False, True):
        scored.clear()
        stopped = greedy_accuracy(
            engine, tokenizer, recorder, examples, 12, stop=[stop], keep_stop_text=keep
        )
        assert scored == [trim_at_stop(t, [stop], keep)[0] for t in free_texts]
        assert stopped["eval/completion_tokens"] < free["eval/completion_tokens"]
        assert stopped["eval/truncated_frac"] <= free["eval/truncated_frac"]
    (free_ids,), _ = greedy_generate(engine, [[3, 4, 5]], 12)
    assert len(free_ids) >= 6, free_ids
    own = tokenizer.decode(free_ids[4:6])
    (ids,), reasons = greedy_generate(engine, [[3, 4, 5]], 12, stop=[own])
    assert reasons == ["stop"] and ids == free_ids[: first_stop(tokenizer, free_ids, [own])]
