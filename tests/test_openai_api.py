"""The OpenAI endpoints of asyncrl's HTTP front (``asyncrl.serving.openai_api``), driven by
the real ``openai`` client: greedy completions equal the embedded engine's own tokens and
the sglang front's logprobs, chat prompts are the tokenizer's chat template, stop strings
and stop tokens end the text, and bad requests are 400s in OpenAI's error shape.

Two servers run in-process (a background event loop): the tiny char-tokenizer model
(``tiny_model_dir``, no chat template) and a tiny Qwen2 with the small Qwen-style
tokenizer and its template (``chat_model_dir``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
from aiohttp import web

from asyncrl.engine.base import Request, SamplingParams
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.engine.stops import trim_at_stop
from asyncrl.models import load_tokenizer
from asyncrl.serving.serve import build_app
from asyncrl.serving.serve_engine import EngineServer

from .test_stops import first_stop

PROMPT = "Calculate 5 - 33. "
MAX_SEQ_LEN = 128
ENGINE = EmbeddedEngineConfig(max_slots=8, max_seq_len=MAX_SEQ_LEN)


@contextlib.contextmanager
def serving(model_dir: str):
    """asyncrl's HTTP front for ``model_dir`` on a free port, its event loop in a thread;
    yields its URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server = EngineServer(EmbeddedEngine(model_dir, ENGINE), model_dir, "v0")
        runner = web.AppRunner(build_app(server))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return server, runner, asyncio.create_task(server.run())

    server, runner, stepping = asyncio.run_coroutine_threadsafe(start(), loop).result(120)

    async def stop():
        stepping.cancel()
        await runner.cleanup()

    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        server.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture(scope="module")
def tiny_url(tiny_model_dir):
    with serving(tiny_model_dir) as url:
        yield url


@pytest.fixture(scope="module")
def chat_url(chat_model_dir):
    with serving(chat_model_dir) as url:
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def engine_greedy(model_dir: str, prompt: list[int], max_new_tokens: int) -> tuple[list, list]:
    """The embedded engine's own greedy tokens and logprobs, no HTTP in between."""
    engine = EmbeddedEngine(model_dir, ENGINE)
    engine.submit(Request("r", prompt, SamplingParams(max_new_tokens, temperature=0.0)))
    tokens = []
    while engine.running or engine.waiting:
        tokens += engine.step().tokens
    engine.close()
    return [t.token_id for t in tokens], [t.logprob for t in tokens]


def greedy(c: openai.OpenAI, prompt, max_tokens: int = 12, **extra):
    return c.completions.create(
        model="m", prompt=prompt, max_tokens=max_tokens, temperature=0.0, **extra
    ).choices[0]


# ---- completions -------------------------------------------------------------------------
def test_greedy_completion_is_the_engines_own_and_the_sglang_fronts(tiny_url, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    prompt = tokenizer.encode(PROMPT)
    out = client(tiny_url).completions.create(
        model="anything",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.0,
        logprobs=0,
        extra_body={"return_token_ids": True, "return_weight_versions": True},
    )
    choice = out.choices[0]
    ids, logprobs = engine_greedy(tiny_model_dir, prompt, 12)
    assert choice.token_ids == ids and choice.prompt_token_ids == prompt
    assert (choice.finish_reason == "length") == (tokenizer.eos_token_id not in ids)
    assert choice.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert choice.weight_versions == [{"version": "v0", "start": 0, "end": len(ids)}]
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == len(ids)
    assert out.usage.total_tokens == len(prompt) + len(ids)
    assert out.object == "text_completion" and out.model == tiny_model_dir
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.top_logprobs == [{t: x} for t, x in zip(lp.tokens, lp.token_logprobs)]
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    body = {"input_ids": prompt, "return_logprob": True}
    body["sampling_params"] = {"max_new_tokens": 12, "temperature": 0.0}
    status, sglang = post(tiny_url + "/generate", json.dumps(body).encode())
    assert status == 200 and sglang["output_ids"] == ids
    front = [e[0] for e in sglang["meta_info"]["output_token_logprobs"]]
    assert lp.token_logprobs == pytest.approx(front, abs=1e-5)
    # A prompt given as token ids is the same request.
    assert greedy(client(tiny_url), prompt).text == choice.text


def test_stop_strings_and_stop_tokens_end_the_completion(tiny_url, tiny_model_dir):
    tokenizer, c = load_tokenizer(tiny_model_dir), client(tiny_url)
    free = greedy(c, PROMPT, extra_body={"return_token_ids": True}).token_ids
    assert len(free) >= 6 and tokenizer.eos_token_id not in free[:6], free
    stop = tokenizer.decode(free[4:6])
    cut = first_stop(tokenizer, free, [stop])
    for keep in (False, True):
        extra = {"return_token_ids": True, "include_stop_str_in_output": keep}
        choice = greedy(c, PROMPT, stop=["?!", stop], extra_body=extra)
        text = tokenizer.decode(free[:cut], skip_special_tokens=True)
        assert choice.token_ids == free[:cut] and choice.text == trim_at_stop(text, [stop], keep)[0]
        assert choice.finish_reason == "stop" and choice.stop_reason == stop
        assert choice.text.endswith(stop) == keep
    extra = {"return_token_ids": True, "stop_token_ids": [free[4]]}
    choice = greedy(c, PROMPT, extra_body=extra)
    cut = free.index(free[4]) + 1
    assert choice.token_ids == free[:cut] and choice.stop_reason == free[4]
    assert choice.text == tokenizer.decode(free[: cut - 1], skip_special_tokens=True)


def test_a_seed_makes_sampling_reproducible(tiny_url):
    c = client(tiny_url)
    extra = {"return_token_ids": True, "top_k": 20}
    runs = [
        c.completions.create(
            model="m", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, extra_body=extra
        ).choices[0]
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].text == runs[1].text


def test_models_lists_the_served_model(tiny_url, tiny_model_dir):
    models = client(tiny_url).models.list().data
    assert [m.id for m in models] == [tiny_model_dir]


# ---- chat --------------------------------------------------------------------------------
MESSAGES = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 6 times 7?"},
]


def test_chat_prompt_is_the_chat_template_and_its_tokens_the_completions(
    chat_url,
    chat_model_dir,
):
    tokenizer, c = load_tokenizer(chat_model_dir), client(chat_url)
    out = c.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_completion_tokens=10,
        temperature=0.0,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    prompt = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out.prompt_token_ids == list(prompt) and out.object == "chat.completion"
    choice = out.choices[0]
    assert 1 <= len(choice.token_ids) <= 10 and choice.message.role == "assistant"
    same = greedy(c, list(prompt), 10, logprobs=0, extra_body={"return_token_ids": True})
    assert choice.token_ids == same.token_ids and choice.message.content == same.text
    content = choice.logprobs.content
    assert [e.logprob for e in content] == pytest.approx(same.logprobs.token_logprobs, abs=1e-5)
    assert [e.token for e in content] == same.logprobs.tokens
    assert all(e.bytes == list(e.token.encode()) and e.top_logprobs == [] for e in content)
    # Text parts are joined, as vLLM does; without return_token_ids no ids come back.
    parts = [{"type": "text", "text": "What is 6"}, {"type": "text", "text": "times 7?"}]
    messages = [MESSAGES[0], {"role": "user", "content": parts}]
    plain = c.chat.completions.create(model="m", messages=messages, max_tokens=3)
    assert getattr(plain, "prompt_token_ids", None) is None
    joined = [MESSAGES[0], {"role": "user", "content": "What is 6\ntimes 7?"}]
    joined = tokenizer.apply_chat_template(joined, add_generation_prompt=True, return_dict=False)
    assert plain.usage.prompt_tokens == len(joined)


# ---- errors ------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    ({"n": 0}, "n"),
    ({"stream": True}, "stream"),
    ({"logprobs": 2}, "logprobs"),
    ({"top_p": 0}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": MAX_SEQ_LEN}, "max_tokens"),
    ({"stop": [""]}, "stop"),
    ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
    ({"extra_body": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    ({"extra_body": {"guided_json": {}}}, "guided_json"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": [5] * MAX_SEQ_LEN}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
]


@pytest.mark.parametrize("change,param", BAD_COMPLETIONS)
def test_bad_completion_requests_are_400s_in_openai_shape(tiny_url, change, param):
    args = {"model": "m", "prompt": PROMPT, "max_tokens": 4, **change}
    with pytest.raises(openai.BadRequestError) as caught:
        client(tiny_url).completions.create(**args)
    error = caught.value
    assert error.status_code == 400 and set(error.body) == {"message", "type", "param", "code"}
    assert error.type == "BadRequestError" and error.body["code"] == 400 and error.param == param
    assert param in error.body["message"] and "sampling_params" not in error.body["message"]


def test_chat_without_a_template_and_bad_chat_requests_are_400s(tiny_url, chat_url):
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client(tiny_url).chat.completions.create(model="m", messages=MESSAGES)
    bad = [
        {"top_logprobs": 2, "logprobs": True},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"max_completion_tokens": 0},
    ]
    for change in bad:
        with pytest.raises(openai.BadRequestError):
            client(chat_url).chat.completions.create(
                **{"model": "m", "messages": MESSAGES, **change}
            )
    status, body = post(chat_url + "/v1/chat/completions", b"{not json")
    # vLLM types what its request schema refuses (a body that is not JSON) "Bad Request".
    assert status == 400 and body["error"]["type"] == "Bad Request"
