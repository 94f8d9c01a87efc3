"""An agent written against the OpenAI API, trained as an episode: ``AgentEnvironment``
runs the user's agent in a thread, its ``openai`` client pointed at a capture server in
this process, and makes each of its chat completion calls one model turn of the episode.

    class Multiply(AgentEnvironment):
        def agent(self, client: openai.OpenAI) -> float:
            messages = [{"role": "user", "content": self.example.prompt}]
            reply = client.chat.completions.create(model=self.model, messages=messages)
            ...  # more calls, tools run in between
            return 1.0 if self.example.answer in reply.choices[0].message.content else 0.0

and ``task.environment = "mymodule:Multiply"`` (with ``task.prompt_format = "chat"``). The
``openai`` package is the agent's dependency (``pip install openai``), not asyncrl's.

How calls become turns. The generator renders the example's prompt and samples the first
turn, as for every episode; meanwhile the agent's first call must end with that prompt as
its last user message (``example.prompt``, or a conversation row's last message). The
call is answered with the model's turn when the generator calls ``step(turn)``, which
then waits for the agent's next move: another call, whose messages must be the previous
call's plus the reply (content equal) plus new messages, the step's observation (chat
messages, rendered after the turn by the generator); or the agent's return, the episode's
reward. Anything else ends the episode with reward 0: a call whose history differs
(counted in ``mismatches``), an agent that raises, or one silent for ``reply_timeout_s``
(counted in ``tool_errors``). ``__init__`` and ``step`` block until the agent moves.
The generator samples every turn with the run's sampling settings and records the tokens
itself, so the agent's sampling keys are ignored and the captured responses carry only
the text (no token ids, logprobs or usage).

The capture server (one per process, on 127.0.0.1 and a free port, started by the first
episode) routes each call to its episode by a path segment in the client's ``base_url``;
it speaks ``/v1/chat/completions`` in ``asyncrl.serving.openai_api``'s shape and with its
checks (no streaming, tools or ``n`` > 1), one call at a time per episode.

Replayable: an agent whose behaviour depends only on the example and the replies (its
randomness seeded from the example) makes the same calls given the same turns, so the
episode replays as ``asyncrl.episodes.env`` requires.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import queue
import secrets
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from asyncrl.episodes.env import Environment, Step
from asyncrl.serving.openai_protocol import (
    Completion,
    chat_completion_body,
    chat_messages,
    error_body,
    models_body,
)
from asyncrl.serving.serve_protocol import BadRequest, decode_body
from asyncrl.tasks.base import Example

if TYPE_CHECKING:
    import openai

log = logging.getLogger("asyncrl.episodes.openai_agent")

Messages = list[dict[str, str]]


@dataclass
class _Call:
    """One chat completion call of the agent, waiting for its reply."""

    messages: Messages
    reply: queue.Queue = field(default_factory=queue.Queue)
    """The model's turn, or None when the call is refused (the episode ended)."""


@dataclass
class _Return:
    """The agent's end: its reward, or the exception it raised."""

    reward: Any = None
    error: BaseException | None = None


class _Channel:
    """The hand-off between one episode's calls (served in capture server threads) and
    its ``step``: calls and the agent's return queue up in ``events``."""

    def __init__(self, model: str) -> None:
        self.token = secrets.token_hex(8)
        self.model = model
        self.events: queue.Queue[_Call | _Return] = queue.Queue()
        self._lock = threading.Lock()
        self._open: _Call | None = None
        self._closed = False

    def call(self, messages: Messages) -> str | None:
        """Block until the episode answers; None when refused (ended, or a call of this
        episode is already open)."""
        call = _Call(messages)
        with self._lock:
            if self._closed or self._open is not None:
                return None
            self._open = call
        self.events.put(call)
        reply = call.reply.get()
        with self._lock:
            self._open = None if self._open is call else self._open
        return reply

    def next_event(self, timeout_s: float) -> _Call | _Return | None:
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Refuse every later call, and the open one."""
        with self._lock:
            self._closed, call = True, self._open
        if call is not None:
            call.reply.put(None)


# ---- the capture server --------------------------------------------------------------------
_REFUSED = "this asyncrl episode has ended (or another of its calls is open: one call at a time)"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client expects
    server: _CaptureServer

    def do_GET(self) -> None:
        channel, route = self._route()
        if channel is not None and route == "/v1/models":
            self._send(200, models_body(channel.model))
        elif channel is not None:
            self._send(404, error_body(f"no GET {route} here", 404))

    def do_POST(self) -> None:
        channel, route = self._route()
        if channel is None:
            return
        if route != "/v1/chat/completions":
            return self._send(404, error_body(f"no POST {route} here", 404))
        try:
            size = int(self.headers.get("Content-Length") or 0)
            body = decode_body(self.rfile.read(size))
            messages = chat_messages(body)
        except BadRequest as exc:
            return self._send(400, error_body(str(exc), 400, getattr(exc, "param", None)))
        reply = channel.call(messages)
        if reply is None:
            return self._send(400, error_body(_REFUSED))
        completion = Completion(id=f"chatcmpl-{uuid.uuid4().hex}", text=reply)
        self._send(200, chat_completion_body(completion, str(body.get("model") or channel.model)))

    def _route(self) -> tuple[_Channel | None, str]:
        """The episode named by the path's first segment, and the rest of the path."""
        token, _, rest = self.path.lstrip("/").partition("/")
        channel = self.server.channels.get(token)
        if channel is None:
            self._send(404, error_body(f"no episode {token!r} here (it has ended?)", 404))
        return channel, "/" + rest

    def _send(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("capture server: " + format, *args)


class _CaptureServer(ThreadingHTTPServer):
    """The process's capture server; ``channels`` maps a path token to its episode."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.channels: dict[str, _Channel] = {}
        self.pid = os.getpid()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True, name="agent-capture").start()


_SERVER: _CaptureServer | None = None
_SERVER_LOCK = threading.Lock()


def capture_server() -> _CaptureServer:
    """This process's capture server, started on first use (again in a forked child)."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or _SERVER.pid != os.getpid():
            _SERVER = _CaptureServer()
        return _SERVER


# ---- the environment -----------------------------------------------------------------------
class AgentEnvironment(Environment):
    """An episode driven by the user's OpenAI-client agent: subclass it and implement
    ``agent`` (see the module docstring); name the subclass in ``task.environment``."""

    reply_timeout_s: float = 60.0
    """How long the agent may take to make its next call or return, after each reply
    (and for its first call); past it the episode ends with reward 0."""
    model: str = "policy"
    """The model name the agent may pass (any name is accepted)."""

    def __init__(self, example: Example) -> None:
        import openai  # the agent's dependency, not asyncrl's: imported where it is needed

        super().__init__(example)
        self.mismatches = 0
        """1 when the episode ended because the agent's calls did not follow it."""
        self._channel = _Channel(self.model)
        server = capture_server()
        server.channels[self._channel.token] = self._channel
        self.base_url = f"{server.url}/{self._channel.token}/v1"
        """Where the agent's calls go (the path names the episode)."""
        self.api_key = "asyncrl"
        self._pending: _Call | None = None
        self._ended: Step | None = None
        # No retries (a retry would repeat a call), no timeout (close() ends every wait).
        client = openai.OpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=None
        )
        self._thread = threading.Thread(
            target=self._run_agent, args=(client,), daemon=True, name=f"agent {example.uid}"
        )
        self._thread.start()
        self._receive(None)  # its first call (or an early end), before the first turn

    def agent(self, client: openai.OpenAI) -> float:
        """The user's agent: make chat completion calls with ``client`` (the first one
        ending with ``self.example``'s prompt as the user message) and return the
        episode's reward. For a framework that builds its own client, ``self.base_url``
        and ``self.api_key`` are what to give it (with retries off)."""
        raise NotImplementedError

    def step(self, turn: str) -> Step:
        if self._ended is not None:
            return self._ended
        call, self._pending = self._pending, None
        self.tool_calls += 1  # the agent's code runs on each turn, as a tool would
        call.reply.put(turn)
        return self._receive([*call.messages, {"role": "assistant", "content": turn}])

    def close(self) -> None:
        self._channel.close()
        capture_server().channels.pop(self._channel.token, None)
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():  # Python cannot stop a thread: it is left behind
            log.warning("episode %s: the agent is still running after close", self.example.uid)

    # ---- internals --------------------------------------------------------------------------
    def _run_agent(self, client: openai.OpenAI) -> None:
        try:
            with client:
                self._channel.events.put(_Return(reward=self.agent(client)))
        except BaseException as exc:
            self._channel.events.put(_Return(error=exc))

    def _receive(self, sent: Messages | None) -> Step:
        """The agent's next move after the reply ending ``sent`` (None: its first call)."""
        event = self._channel.next_event(self.reply_timeout_s)
        if event is None:
            return self._end(error=f"no call or return within {self.reply_timeout_s:g} s")
        if isinstance(event, _Return):
            return self._returned(event, first=sent is None)
        if sent is None:
            problem = _first_call_problem(event.messages, self.example)
        else:
            problem = _history_problem(sent, event.messages)
        if problem:
            return self._end(mismatch=problem)
        self._pending = event
        return Step(observation=event.messages[len(sent) :] if sent else "")

    def _returned(self, event: _Return, first: bool) -> Step:
        if event.error is not None:
            error = event.error
            return self._end(error=f"the agent raised {type(error).__name__}: {error}")
        if first:
            return self._end(mismatch="the agent returned without calling the model")
        reward = event.reward
        if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            return self._end(error=f"the agent returned {reward!r:.80}, not a reward")
        return self._end(float(reward))

    def _end(self, reward: float = 0.0, error: str = "", mismatch: str = "") -> Step:
        """End the episode (refusing the agent's later calls); ``error`` and ``mismatch``
        are counted and logged."""
        if error:
            self.tool_errors += 1
            log.warning("episode %s ends: %s", self.example.uid, error)
        if mismatch:
            self.mismatches += 1
            log.warning(
                "episode %s ends, its calls do not follow it: %s", self.example.uid, mismatch
            )
        self._channel.close()
        self._ended = Step(reward=reward, done=True)
        return self._ended


def _first_call_problem(messages: Messages, example: Example) -> str:
    """Why the agent's first call does not end with the task's prompt ("" if it does)."""
    expected = (example.messages or ({"role": "user", "content": example.prompt},))[-1]
    last = messages[-1]
    if (last["role"], last["content"]) != (expected["role"], expected["content"]):
        return f"its first call ends with {last!r:.120}, not the task's prompt {expected!r:.120}"
    return ""


def _history_problem(sent: Messages, messages: Messages) -> str:
    """Why ``messages`` is not ``sent`` followed by new messages ("" if it is)."""
    for i, (was, now) in enumerate(zip(sent, messages)):
        if was != now:
            what = "the model's reply" if i == len(sent) - 1 else "an earlier message"
            return f"messages[{i}] ({what}) was {was!r:.120}, the next call has {now!r:.120}"
    if len(messages) <= len(sent):
        return f"the next call's {len(messages)} messages add none after the model's reply"
    return ""
