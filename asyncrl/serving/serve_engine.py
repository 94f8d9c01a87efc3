"""The engine behind ``asyncrl.serving.serve``'s HTTP front: one ``EngineServer`` owns an
``EmbeddedEngine``, the asyncio task that steps it, and the requests in flight.

The task runs ``engine.step`` in a worker thread (torch releases the GIL, so the event
loop keeps serving). Everything that touches the engine's state — submitting, aborting,
pausing, flipping in new weights — is a command the task runs between two steps, so
requests from every connection join the running batch (continuous batching) and never
race a step. Each step's tokens are appended to their request's ``Generation``
(``serve_protocol``) and wake the handler waiting on it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count

import torch

from asyncrl.engine.base import Request, StepOutput
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.weight_dirs import read_weights_dir
from asyncrl.models import load_tokenizer, model_config
from asyncrl.serving.serve_protocol import BadRequest, GenerateInput
from asyncrl.serving.sglang_response import Generation, finish_reason_json

log = logging.getLogger("asyncrl.serve")


@dataclass
class Flight:
    """A request in flight; ``changed`` is set whenever its generation grows or ends."""

    gen: Generation
    engine_id: str
    """The id inside the engine: unique per submission, so a late report about an
    earlier request that reused a ``rid`` is never applied to this one."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class EngineServer:
    """The engine, the task that steps it, and the requests in flight. Engine state is
    only touched between steps, by ``run`` (commands queue in ``_commands``)."""

    def __init__(self, engine: EmbeddedEngine, model_path: str, weight_version: str) -> None:
        self.engine = engine
        self.model_path = model_path
        self.tokenizer_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        self.vocab_size = model_config(model_path).vocab_size
        self.labels = {engine.version: weight_version}
        """Weight-version label of each engine version."""
        self.flights: dict[str, Flight] = {}
        self._by_engine_id: dict[str, Flight] = {}
        self._ids = count()
        self._commands: list[tuple[Callable, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._stepper = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self.paused = False
        self.refusing: str | None = None
        """Why new OpenAI requests are refused with 503 now (vLLM 0.33 on, paused)."""
        self.sleep_after_step = 0.0
        self.healthy = True
        self._stopped = False

    @property
    def weight_version(self) -> str:
        return self.labels[self.engine.version]

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def response(self, flight: Flight) -> dict:
        return flight.gen.response(self.decode, self.weight_version)

    # ---- commands: run between two steps ----------------------------------------------
    def between_steps(self, fn: Callable) -> asyncio.Future:
        """Run ``fn`` (a function, or one returning an awaitable) between two steps; the
        future holds its result or exception."""
        future = asyncio.get_running_loop().create_future()
        if self._stopped:
            future.set_exception(RuntimeError("the engine loop has stopped"))
        else:
            self._commands.append((fn, future))
            self._wake.set()
        return future

    def soon(self, fn: Callable) -> None:
        """``between_steps`` for a caller that does not wait for the outcome."""
        self.between_steps(fn).add_done_callback(lambda f: f.cancelled() or f.exception())

    def submit(self, inp: GenerateInput) -> Flight:
        """Register and queue a request; raises ``BadRequest`` for a rid in flight and
        ``RuntimeError`` once the engine loop has stopped."""
        if self._stopped:
            raise RuntimeError("the engine loop has stopped")
        if inp.rid in self.flights:
            raise BadRequest(f"rid {inp.rid!r} is already in flight")
        flight = Flight(Generation(inp), f"{inp.rid}#{next(self._ids)}")
        self.flights[inp.rid] = flight
        self._by_engine_id[flight.engine_id] = flight
        request = Request(flight.engine_id, inp.prompt_ids, inp.params)

        def command() -> None:
            try:
                self.engine.submit(request)
            except ValueError as exc:  # parse_generate should have caught it
                self._finish(flight, finish_reason_json("abort", None, 0, str(exc)))

        self.soon(command)
        return flight

    def _finish(self, flight: Flight, reason: dict) -> None:
        flight.gen.finish_reason = reason
        self.flights.pop(flight.gen.input.rid, None)
        self._by_engine_id.pop(flight.engine_id, None)
        flight.changed.set()

    def _abort_now(self, flight: Flight, message: str, status: int | None = None) -> None:
        if flight.gen.finish_reason is None:
            self.engine.abort(flight.engine_id)
            self._finish(flight, finish_reason_json("abort", None, 0, message, status))

    def _abort_command(self, rid: str, message: str) -> Callable[[], None]:
        """sglang's abort of ``rid``: nothing unless a request of exactly that rid is in
        flight (its tokenizer manager's check); then that request and every one whose rid
        starts with ``rid`` (its scheduler matches by prefix)."""

        def command() -> None:
            if rid in self.flights:
                for other, flight in list(self.flights.items()):
                    if other.startswith(rid):
                        self._abort_now(flight, message)

        return command

    async def abort(self, rid: str, message: str = "Aborted by /abort_request") -> None:
        await self.between_steps(self._abort_command(rid, message))

    def abort_soon(self, rid: str, message: str) -> None:
        self.soon(self._abort_command(rid, message))

    async def abort_all(
        self, message: str = "Aborted by /abort_request", status: int | None = None
    ) -> None:
        def command() -> None:
            for flight in list(self.flights.values()):
                self._abort_now(flight, message, status)

        await self.between_steps(command)

    async def pause(self, mode: str) -> None:
        def command() -> None:
            if mode == "abort":
                for flight in list(self.flights.values()):
                    self._abort_now(flight, "Aborted by /pause_generation")
            self.paused = True

        await self.between_steps(command)

    async def resume(self) -> None:
        def command() -> None:
            self.paused = False

        await self.between_steps(command)

    async def update_weights(self, model_path: str, label: str | None) -> None:
        loop = asyncio.get_running_loop()
        # Reading the files is slow and touches no engine state: do it while decoding.
        state = await loop.run_in_executor(None, read_weights_dir, model_path)
        await self.apply_weights(state, label, model_path)

    async def apply_weights(
        self, state: dict[str, torch.Tensor], label: str | None, model_path: str | None = None
    ) -> None:
        """Flip the engine to ``state`` between two steps, labelled ``label`` (None: keep
        the current label); ``model_path`` is where they came from, if a directory."""
        loop = asyncio.get_running_loop()

        async def command() -> None:
            version = max(self.labels) + 1
            self.labels[version] = label if label is not None else self.weight_version
            try:
                await loop.run_in_executor(self._stepper, self.engine.load_weights, state, version)
            except Exception:
                del self.labels[version]
                raise
            self.model_path = model_path or self.model_path

        await self.between_steps(command)

    # ---- the stepping loop --------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                await self._run_commands()
                if self.paused or not (self.engine.running or self.engine.waiting):
                    continue
                out = await loop.run_in_executor(self._stepper, self.engine.step)
                self._deliver(out)
                if self.sleep_after_step > 0:
                    await asyncio.sleep(self.sleep_after_step)
                self._wake.set()
        except Exception:
            self.healthy = False
            log.exception("the engine loop failed; aborting every request")
            for flight in list(self.flights.values()):
                self._finish(flight, finish_reason_json("abort", None, 0, "engine failure", 500))
            raise
        finally:
            self._stopped = True
            for _, future in self._commands:
                if not future.done():
                    future.set_exception(RuntimeError("the engine loop has stopped"))

    async def _run_commands(self) -> None:
        commands, self._commands = self._commands, []
        for fn, future in commands:
            try:
                result = fn()
                if inspect.isawaitable(result):
                    result = await result
            except Exception as exc:  # reported to the caller, who answers 400
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(result)

    def _deliver(self, out: StepOutput) -> None:
        for token in out.tokens:
            flight = self._by_engine_id.get(token.request_id)
            if flight is None:
                continue  # finished already (we finish aborted requests ourselves)
            gen = flight.gen
            gen.output_ids.append(token.token_id)
            gen.logprobs.append(token.logprob)
            gen.versions.append(self.labels[token.version])
            flight.changed.set()
        for done in out.finished:
            flight = self._by_engine_id.get(done.request_id)
            if flight is not None:  # None: an abort we reported when we made it
                last = flight.gen.output_ids[-1] if flight.gen.output_ids else None
                matched = last if done.matched is None else done.matched
                self._finish(flight, finish_reason_json(done.reason, matched, done.num_tokens))

    def close(self) -> None:
        self._stepper.shutdown(wait=True)
        self.engine.close()
