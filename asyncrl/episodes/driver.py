"""A generator's episodes (``task.environment``): each lease is one episode, run turn by
turn on the generator's engine, its turns streamed to the buffer as they finish.

A lease's episode is built (or rebuilt, from a re-issued lease's prefix) in a thread
pool, and every environment step runs there too, so the decode loop never waits for an
environment: other episodes and other groups keep decoding meanwhile. A model turn is an
engine request for the episode's whole context; when it finishes, the environment
answers it in the pool, and the turn and its observation go to the buffer as one chunk
(whole turns only, so a continued episode starts at a turn's end) before the next turn
is submitted. The last chunk carries the environment's reward and the episode's figures.
Weights may flip between or within turns: each token keeps the version that sampled it.
Since no tokens flow while a turn decodes or an environment works, every episode sends an
empty chunk each ``transport.heartbeat_s`` meanwhile: the buffer takes a lease back when
its holder makes no progress, and a long turn is progress.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from asyncrl.buffer.config import RolloutConfig
from asyncrl.engine.base import Request
from asyncrl.engine.leases import PendingLease, sampling_params
from asyncrl.episodes.env import load_environment
from asyncrl.episodes.episode import Episode, EpisodeRules
from asyncrl.interfaces import Engine
from asyncrl.models import load_tokenizer
from asyncrl.tasks import build_task
from asyncrl.wire import Lease

log = logging.getLogger(__name__)

Send = Callable[[PendingLease, bool, "str | None"], None]
"""``send(pending, finished, finish_reason)``: the generator's chunk sender."""

MAX_TURN_RETRIES = 3
"""A turn the engine aborted (a remote server that failed) is sampled again, from the same
context, this many times before its episode fails."""


class EpisodeDriver:
    """Runs the episodes of the leases given to ``start`` on ``engine``, registering each
    turn's request in ``pending`` (the generator's table of running leases) and handing
    chunks to ``send``."""

    def __init__(
        self, cfg: RolloutConfig, engine: Engine, pending: dict[str, PendingLease], send: Send
    ) -> None:
        self.examples = build_task(cfg.task).examples(cfg.task.rl_split)
        self.env_cls = load_environment(cfg.task.environment)
        s = cfg.sampling
        self.rules = EpisodeRules.for_task(
            cfg.task,
            load_tokenizer(cfg.model.path),
            s.max_new_tokens,
            s.stop,
            s.stop_token_ids,
            s.keep_stop_text,
        )
        self.engine, self.pending, self.send = engine, pending, send
        self.keep_alive_s = cfg.transport.heartbeat_s
        self.episodes: dict[str, tuple[Episode | None, PendingLease]] = {}
        self.working: dict[str, Future] = {}
        """Lease id → the environment's work in the pool (building, or answering a turn)."""
        self.retries: dict[str, int] = {}
        """Lease id → its current turn's samplings the engine aborted."""
        self.pool = ThreadPoolExecutor(cfg.task.env_threads, thread_name_prefix="env")

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self.episodes

    def lease_ids(self) -> set[str]:
        """The leases of the episodes under way, between turns or in one."""
        return set(self.episodes)

    def between_turns(self) -> int:
        """Episodes whose environment is working: they hold no engine slot, and the
        generator should not sleep."""
        return len(self.working)

    def start(self, lease: Lease, now: float) -> None:
        p = PendingLease(lease, last_flush=now, whole_turns=True)
        self.episodes[lease.lease_id] = (None, p)
        self.working[lease.lease_id] = self.pool.submit(self._open, lease, p)

    def turn_finished(self, p: PendingLease, reason: str) -> None:
        """A model turn ended (its tokens are in ``p``): the environment answers it. A
        turn the engine aborted is no turn: it is sampled again (its tokens were never
        sent), and after ``MAX_TURN_RETRIES`` the episode fails."""
        lease_id = p.lease.lease_id
        episode, _ = self.episodes[lease_id]
        if reason == "abort":
            p.token_ids, p.logprobs, p.versions = [], [], []
            self.retries[lease_id] = self.retries.get(lease_id, 0) + 1
            if self.retries[lease_id] <= MAX_TURN_RETRIES:
                self._next_turn(episode, p)
            else:
                log.warning(
                    "episode %s: the engine aborted its turn %d times",
                    lease_id,
                    MAX_TURN_RETRIES + 1,
                )
                self._end(lease_id, episode, p, "error")
            return
        self.retries.pop(lease_id, None)
        episode.add_turn(list(p.token_ids), list(p.logprobs), list(p.versions))
        p.loss_mask = [1] * len(p.token_ids)
        self.working[p.lease.lease_id] = self.pool.submit(self._respond, episode, p)

    def abort(self, lease_id: str) -> None:
        """Forget a lease the buffer took back; its environment is closed once its work
        in the pool (building it, or answering a turn) ends."""
        entry = self.episodes.pop(lease_id, None)
        future = self.working.pop(lease_id, None)
        self.retries.pop(lease_id, None)
        if future is not None:  # closed in the pool: a close may block (an agent's thread)
            future.add_done_callback(lambda f: self._in_pool(_close_built, f))
        elif entry is not None and entry[0] is not None:
            self._in_pool(entry[0].env.close)

    def poll(self, now: float) -> None:
        """Send what the environments finished, submit the next turns, and renew the
        leases of episodes that sent nothing for ``keep_alive_s``."""
        for _, p in self.episodes.values():
            if now - p.last_flush >= self.keep_alive_s:
                self.send(PendingLease(p.lease, seq=p.seq), False, None)  # no tokens
                p.seq, p.last_flush = p.seq + 1, now
        for lease_id, future in list(self.working.items()):
            if not future.done():
                continue
            del self.working[lease_id]
            _, p = self.episodes[lease_id]
            error = future.exception()
            if error is not None:  # building or answering failed: the group fails
                log.warning("episode %s: %s: %s", lease_id, type(error).__name__, error)
                self.episodes.pop(lease_id)
                self.send(p, True, "error")
                continue
            episode = future.result()
            self.episodes[lease_id] = (episode, p)
            if episode.finish_reason is not None:
                self._finish(lease_id, episode, p)
                continue
            if p.token_ids:
                self.send(p, False, None)
            self._next_turn(episode, p)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- internals -------------------------------------------------------------------
    def _open(self, lease: Lease, p: PendingLease) -> Episode:
        """The lease's episode, rebuilt from its prefix; a last turn that was never
        answered is answered now (its observation goes out with the next chunk)."""
        env = self.env_cls(self.examples[lease.prompt_id])
        episode = Episode(env, list(lease.prompt_ids), self.rules)
        try:
            prefix = (lease.prefix_ids, lease.prefix_logprobs, lease.prefix_versions)
            if episode.replay(*prefix, lease.prefix_mask):
                self._respond(episode, p)
        except BaseException:
            env.close()
            raise
        return episode

    def _respond(self, episode: Episode, p: PendingLease) -> Episode:
        try:  # an environment that raises ends its episode; rendering may still fail
            start, end = episode.respond()
        except BaseException:
            episode.env.close()
            raise
        p.token_ids += episode.token_ids[start:end]
        p.logprobs += episode.logprobs[start:end]
        p.versions += episode.versions[start:end]
        p.loss_mask += episode.loss_mask[start:end]
        return episode

    def _next_turn(self, episode: Episode, p: PendingLease) -> None:
        s = p.lease.sampling  # one seed for every turn: a draw is keyed by its position
        params = sampling_params(s, episode.budget(), s.seed)
        lease_id = p.lease.lease_id
        try:
            self.engine.submit(Request(lease_id, episode.context(), params))
        except ValueError as e:  # longer than the engine holds: the preflight sizes it
            log.warning("episode %s refused by the engine: %s", lease_id, e)
            self._end(lease_id, episode, p, "error")
            return
        self.pending[lease_id] = p

    def _finish(self, lease_id: str, episode: Episode, p: PendingLease) -> None:
        p.reward, p.episode = episode.reward, episode.figures()
        self._end(lease_id, episode, p, episode.finish_reason)

    def _end(self, lease_id: str, episode: Episode, p: PendingLease, reason: str) -> None:
        self.episodes.pop(lease_id)
        self.retries.pop(lease_id, None)
        self.send(p, True, reason)
        self._in_pool(episode.env.close)

    def _in_pool(self, fn, *args) -> None:
        with contextlib.suppress(RuntimeError):  # shut down: the process is ending
            self.pool.submit(fn, *args)


def _close_built(future: Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().env.close()
