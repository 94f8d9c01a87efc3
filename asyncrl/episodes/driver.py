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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from asyncrl.engine.base import Request, SamplingParams
from asyncrl.episodes.env import load_environment
from asyncrl.episodes.episode import Episode, EpisodeRules
from asyncrl.interfaces import Engine
from asyncrl.models import load_tokenizer
from asyncrl.rollout import PendingLease, RolloutConfig
from asyncrl.tasks import build_task
from asyncrl.tasks.prompts import PromptRenderer
from asyncrl.wire import Lease

log = logging.getLogger(__name__)

Send = Callable[[PendingLease, bool, "str | None"], None]
"""``send(pending, finished, finish_reason)``: the generator's chunk sender."""

ENV_THREADS = 8
"""Environment steps run at once; more wait. Steps are short next to a model turn."""

SEED_STRIDE = 1_000_003
"""Turn k of a seeded lease samples with seed + k·stride: turns draw distinct randomness."""


def episode_rules(cfg: RolloutConfig) -> EpisodeRules:
    """The rules every episode of ``cfg``'s task follows."""
    renderer = PromptRenderer.for_task(cfg.task, load_tokenizer(cfg.model.path))
    s = cfg.sampling
    return EpisodeRules(
        renderer,
        max_turns=cfg.task.max_turns,
        max_tokens=cfg.task.max_episode_tokens,
        turn_tokens=s.max_new_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        keep_stop_text=s.keep_stop_text,
    )


class EpisodeDriver:
    """Runs the episodes of the leases given to ``start`` on ``engine``, registering each
    turn's request in ``pending`` (the generator's table of running leases) and handing
    chunks to ``send``."""

    def __init__(
        self, cfg: RolloutConfig, engine: Engine, pending: dict[str, PendingLease], send: Send
    ) -> None:
        self.examples = build_task(cfg.task).examples(cfg.task.rl_split)
        self.env_cls = load_environment(cfg.task.environment)
        self.rules = episode_rules(cfg)
        self.engine, self.pending, self.send = engine, pending, send
        self.episodes: dict[str, tuple[Episode | None, PendingLease]] = {}
        self.working: dict[str, Future] = {}
        """Lease id → the environment's work in the pool (building, or answering a turn)."""
        self.pool = ThreadPoolExecutor(max_workers=ENV_THREADS, thread_name_prefix="env")

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self.episodes

    def waiting(self) -> bool:
        """Whether an environment is working (the generator should not sleep)."""
        return bool(self.working)

    def start(self, lease: Lease, now: float) -> None:
        p = PendingLease(lease, last_flush=now, whole_turns=True)
        self.episodes[lease.lease_id] = (None, p)
        self.working[lease.lease_id] = self.pool.submit(self._open, lease, p)

    def turn_finished(self, p: PendingLease, reason: str) -> None:
        """A model turn ended (its tokens are in ``p``): the environment answers it."""
        episode, _ = self.episodes[p.lease.lease_id]
        episode.add_turn(list(p.token_ids), list(p.logprobs), list(p.versions))
        p.loss_mask = [1] * len(p.token_ids)
        self.working[p.lease.lease_id] = self.pool.submit(self._respond, episode, p)

    def abort(self, lease_id: str) -> None:
        """Forget a lease the buffer took back; its environment is closed once its work
        in the pool (building it, or answering a turn) ends."""
        entry = self.episodes.pop(lease_id, None)
        future = self.working.pop(lease_id, None)
        if future is not None:
            future.add_done_callback(_close_built)
        elif entry is not None and entry[0] is not None:
            self.pool.submit(entry[0].env.close)

    def poll(self) -> None:
        """Send what the environments finished, and submit the next turns."""
        for lease_id, future in list(self.working.items()):
            if not future.done():
                continue
            del self.working[lease_id]
            _, p = self.episodes[lease_id]
            error = future.exception()
            if error is not None:  # building the environment failed: its group fails
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
        if episode.replay(
            lease.prefix_ids, lease.prefix_logprobs, lease.prefix_versions, lease.prefix_mask
        ):
            self._respond(episode, p)
        return episode

    def _respond(self, episode: Episode, p: PendingLease) -> Episode:
        start, end = episode.respond()
        p.token_ids += episode.token_ids[start:end]
        p.logprobs += episode.logprobs[start:end]
        p.versions += episode.versions[start:end]
        p.loss_mask += episode.loss_mask[start:end]
        return episode

    def _next_turn(self, episode: Episode, p: PendingLease) -> None:
        s = p.lease.sampling
        params = SamplingParams(
            max_new_tokens=episode.budget(),
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=None if s.seed is None else s.seed + SEED_STRIDE * episode.turns,
            stop_token_ids=list(s.stop_token_ids),
            stop=list(s.stop),
        )
        lease_id = p.lease.lease_id
        try:
            self.engine.submit(Request(lease_id, episode.context(), params))
        except ValueError as e:  # longer than the engine holds: the preflight sizes it
            log.warning("episode %s refused by the engine: %s", lease_id, e)
            self.episodes.pop(lease_id)
            self.send(p, True, "error")
            return
        self.pending[lease_id] = p

    def _finish(self, lease_id: str, episode: Episode, p: PendingLease) -> None:
        p.reward, p.episode = episode.reward, episode.figures()
        self.episodes.pop(lease_id)
        self.send(p, True, episode.finish_reason)
        self.pool.submit(episode.env.close)


def _close_built(future: Future) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().env.close()
