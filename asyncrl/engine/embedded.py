"""The embedded engine: asyncrl's own torch inference engine (docs/design.md, Engines).

Continuous batching over a preallocated slot KV cache: requests wait in a queue, join
the running batch between steps (new prompts prefilled together) and leave it when they
finish or are aborted. Running sequences occupy slots ``0 … n-1``: when one leaves, the
last one's cache moves into the hole, so attention reads the cache through views. Each
step gives every running request one token with its behavior logprob and weights
version; one ends at EOS, a stop token or string (``asyncrl.engine.stops``), or length.

It implements the ``Engine`` protocol (``asyncrl.interfaces``), configured by
``EmbeddedEngineConfig`` (``engine.embedded.*``). Weights are double-buffered
(docs/design.md, Weights without stopping generation): ``stage_weights`` hands a state dict
(or one read from a directory) to the engine's ``WeightStager`` (``asyncrl.engine.stager``),
whose thread (a lower priority with ``yield_staging``) puts it into the idle copy of the
model while decoding goes on; the next ``step`` swaps the two by reference, so a flip costs
no copy on the decode path.
In-flight sequences then follow ``flip_policy``: ``keep`` (the default) continues on the old
cache, ``recompute`` re-prefills their tokens under the new weights (AReaL's interruptible
generation).

An engine sharing its process with a trainer (colocated, evaluation on rank 0) gives its
memory back while the trainer works: ``release_memory`` frees the KV cache and both
weight copies, ``load_weights`` then ``resume_memory`` take them back (the hybrid-engine
pattern); ``released=True`` starts an engine that way.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from asyncrl.background import BACKGROUND_NICENESS
from asyncrl.engine.base import EngineStatus, Finished, GeneratedToken, Request, StepOutput, Weights
from asyncrl.engine.config import EmbeddedEngineConfig
from asyncrl.engine.decoder import CachedDecoder, KVCache
from asyncrl.engine.sampling import sample
from asyncrl.engine.stager import WeightStager
from asyncrl.engine.stops import StopChecker
from asyncrl.engine.weight_dirs import read_weights_dir
from asyncrl.models import ModelConfig, empty_model, load_model, weightless_model


@dataclass
class _Sequence:
    request: Request
    slot: int
    tokens: list[int]
    """Prompt then generated tokens; K/V of all but the last are in the cache."""
    generated: int = 0


@dataclass
class _Counters:
    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    shared_prefill_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    flips: int = 0
    recomputed_tokens: int = 0
    last_step_ms: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)


class EmbeddedEngine:
    def __init__(
        self,
        model_path: str,
        cfg: EmbeddedEngineConfig | None = None,
        version: int = 0,
        *,
        released: bool = False,
        yield_staging: bool = False,
    ) -> None:
        self.cfg = cfg = cfg or EmbeddedEngineConfig()
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if use_cuda else "cpu")
        model_cfg = ModelConfig(path=model_path, dtype=cfg.dtype)
        # Two copies: the active one decodes, the idle one receives updates (empty: released).
        load = weightless_model if released else load_model
        copies = [CachedDecoder(load(model_cfg, self.device).eval()) for _ in range(2)]
        # A lower priority only for callers that decode meanwhile: nobody waits for it.
        niceness = BACKGROUND_NICENESS if yield_staging else 0
        self.weights = WeightStager(*copies, self.device, niceness)
        self.shapes = {name: p.shape for name, p in empty_model(model_cfg).named_parameters()}
        """Each weight's shape, by name (a tied weight under its first name)."""
        config = self.weights.active.model.config
        self.max_seq_len = cfg.max_seq_len or config.max_position_embeddings
        self.cache: KVCache | None = None
        if not released:
            self.cache = KVCache.allocate(
                self.weights.active.model, cfg.max_slots, self.max_seq_len
            )
        eos = self.weights.active.model.generation_config.eos_token_id
        if eos is None:
            eos = config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.stops = StopChecker(model_path)  # loads the tokenizer at the first stop string
        self.version = version
        self.slots: list[_Sequence] = []
        """Running sequences by slot: ``slots[i].slot == i``."""
        self.running: dict[str, _Sequence] = {}
        self.waiting: deque[Request] = deque()
        self._aborted: list[Finished] = []
        self.counters = _Counters()

    # ---- the interface -------------------------------------------------------------
    def submit(self, request: Request) -> None:
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id!r}: empty prompt")
        if len(request.prompt_ids) >= self.max_seq_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {len(request.prompt_ids)} tokens does "
                f"not fit max_seq_len={self.max_seq_len}"
            )
        if request.request_id in self.running or any(
            r.request_id == request.request_id for r in self.waiting
        ):
            raise ValueError(f"request {request.request_id!r} is already queued or running")
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        seq = self.running.pop(request_id, None)
        if seq is not None:
            self._release(seq)
            self._aborted.append(Finished(request_id, "abort", seq.generated))
        else:
            queued = [r for r in self.waiting if r.request_id == request_id]
            if not queued:
                return  # already finished: nothing to free
            self.waiting.remove(queued[0])
            self._aborted.append(Finished(request_id, "abort", 0))
        self.counters.aborted += 1

    def stage_weights(self, weights: Weights, version: int, *, wait: bool = False) -> None:
        """Offer weights ``version``: a state dict, whose tensors the engine takes over (the
        caller must not modify them afterwards), or an HF directory, read here on the
        caller's thread. The engine flips to them at the next step boundary; with ``wait``,
        it flips now, once they are staged (see ``load_weights``)."""
        state_dict = weights if isinstance(weights, Mapping) else read_weights_dir(weights)
        expected = self.shapes
        # Tied weights (lm_head = embed_tokens) appear twice in a state dict; accept both.
        unknown = sorted(set(state_dict) - set(self.weights.idle.model.state_dict()))
        missing = sorted(set(expected) - set(state_dict))
        wrong = sorted(
            n for n in expected if n in state_dict and state_dict[n].shape != expected[n]
        )
        if unknown or missing or wrong:
            raise ValueError(
                f"weights v{version} do not fit the model: unknown {unknown[:3]}, "
                f"missing {missing[:3]}, wrong shape {wrong[:3]}"
            )
        self.weights.offer(state_dict, version)
        if wait:
            self._flip_when_staged(version)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """``stage_weights`` then flip now, waiting for the staging thread: for a caller that
        is not decoding meanwhile (the colocated placement, evaluation), so its next step
        already generates with ``version``. Takes ownership of the tensors."""
        self.stage_weights(state_dict, version, wait=True)

    def step(self) -> StepOutput:
        start = time.perf_counter()
        self._maybe_flip()
        if self.cache is None and (self.waiting or self.slots):
            raise RuntimeError("the engine's memory is released: load_weights, resume_memory")
        tokens: list[GeneratedToken] = []
        finished, self._aborted = self._aborted, []
        decoding = list(self.slots)  # slots 0 … n-1
        admitted = self._admit()  # slots n … n+k-1
        # Both forward passes run before any sequence leaves (and moves slots).
        if decoding:
            decode_logits = self.weights.active.decode(
                self.cache,
                0,
                [s.tokens[-1] for s in decoding],
                [len(s.tokens) - 1 for s in decoding],
            )
        if admitted:
            admitted, prefill_logits = self._prefill(admitted)
        if decoding:
            self._emit(decoding, decode_logits, tokens, finished)
        if admitted:
            self._emit(admitted, prefill_logits, tokens, finished)
        self.counters.steps += 1
        self.counters.tokens += len(tokens)
        self.counters.last_step_ms = (time.perf_counter() - start) * 1000
        return StepOutput(tokens=tokens, finished=finished, version=self.version)

    def status(self) -> EngineStatus:
        c = self.counters
        running, waiting, free = len(self.running), len(self.waiting), self.free_slots
        # Weights staged and waiting for the next step's flip (-1: none), so callers can
        # time staging and know when an offered version will be used.
        staged = -1 if self.weights.ready is None else self.weights.ready
        metrics = {
            "engine/running": running,
            "engine/waiting": waiting,
            "engine/free_slots": free,
            "engine/version": self.version,
            "engine/staged_version": staged,
        }
        metrics |= {f"engine/{k}": v for k, v in vars(c).items() if k != "reasons"}
        return EngineStatus(
            running, waiting, free, self.version, staged, c.tokens, c.prefill_tokens, metrics
        )

    # ---- memory, for a process shared with a trainer -------------------------------------
    def score(self, tokens: list[int]) -> tuple[int, list[float]]:
        """``ProbeScorer.score``: on the decode thread, as ``step`` is."""
        return self.version, self.weights.active.score(tokens)

    def release_memory(self) -> None:
        """Free the KV cache and both copies of the weights (each parameter keeps its
        dtype and device, with no elements). The engine must be idle, with no weights
        being staged; ``load_weights`` then ``resume_memory`` make it decode again."""
        if self.weights.busy or not self.idle:
            raise RuntimeError("release_memory needs an idle engine with no weights staging")
        self.cache = None
        self.weights.active.release()
        self.weights.idle.release()

    def resume_memory(self) -> None:
        """Allocate the KV cache again after ``release_memory``, once ``load_weights`` has
        put weights into the active copy (the idle one stays empty until the next
        staging fills it)."""
        params = dict(self.weights.active.model.named_parameters())
        if any(params[name].shape != shape for name, shape in self.shapes.items()):
            raise RuntimeError("resume_memory needs weights: call load_weights first")
        if self.cache is None:
            self.cache = KVCache.allocate(
                self.weights.active.model, self.cfg.max_slots, self.max_seq_len
            )

    @property
    def memory_bytes(self) -> int:
        """Bytes the engine holds in weights (both copies) and KV cache."""
        cache = self.cache.nbytes if self.cache is not None else 0
        return self.weights.active.nbytes + self.weights.idle.nbytes + cache

    def close(self) -> None:
        self.weights.close()

    # ---- internals -----------------------------------------------------------------
    def _admit(self) -> list[_Sequence]:
        admitted, budget, seen = [], self.cfg.max_prefill_tokens, set()
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            key = tuple(req.prompt_ids)
            cost = 0 if self.cfg.share_prefill and key in seen else len(key)
            if admitted and cost > budget:
                break
            self.waiting.popleft()
            budget -= cost
            seen.add(key)
            seq = _Sequence(req, len(self.slots), list(req.prompt_ids))
            self.slots.append(seq)
            self.running[req.request_id] = seq
            admitted.append(seq)
        return admitted

    def _prefill(self, admitted: list[_Sequence]) -> tuple[list[_Sequence], torch.Tensor]:
        """Prefill the sequences just admitted (slots ``n … n+k-1``); returns them in slot
        order with their logits ``[k, V]``.

        With ``share_prefill``, each distinct token list is prefilled once: the first
        sequence with each list moves to the front of the admitted slots, so that one
        contiguous prefill covers them, and every repeat gets a copy of its K/V and its
        logits row (from which it samples its own token)."""
        base = admitted[0].slot
        row_of: dict[tuple[int, ...], int] = {}  # token list -> its leader's offset from base
        leaders, repeats = [], []  # repeats: (sequence, its leader's offset)
        for seq in admitted:
            key = tuple(seq.tokens)
            row = row_of.get(key) if self.cfg.share_prefill else None
            if row is None:
                row_of[key] = len(leaders)
                leaders.append(seq)
            else:
                repeats.append((seq, row))
        order = leaders + [seq for seq, _ in repeats]
        for i, seq in enumerate(order):
            seq.slot = base + i
            self.slots[base + i] = seq
        logits = self.weights.active.prefill(self.cache, base, [s.tokens for s in leaders])
        for seq, row in repeats:
            self.cache.move(base + row, seq.slot, len(seq.tokens))
        self.counters.prefill_tokens += sum(len(s.tokens) for s in leaders)
        self.counters.shared_prefill_tokens += sum(len(s.tokens) for s, _ in repeats)
        if repeats:
            logits = torch.cat([logits, logits[[row for _, row in repeats]]])
        return order, logits

    @property
    def free_slots(self) -> int:
        return self.cfg.max_slots - len(self.slots)

    @property
    def idle(self) -> bool:
        """Nothing queued or running, and no abort left for a step to report."""
        return not (self.running or self.waiting or self._aborted)

    def _release(self, seq: _Sequence) -> None:
        """Free ``seq``'s slot, moving the last running sequence into it."""
        last = self.slots.pop()
        if last is not seq:
            self.cache.move(last.slot, seq.slot, len(last.tokens))
            last.slot = seq.slot
            self.slots[seq.slot] = last

    def _emit(
        self, seqs: list[_Sequence], logits: torch.Tensor, tokens: list, finished: list
    ) -> None:
        ids, logprobs = sample(
            logits, [s.request.params for s in seqs], [len(s.tokens) for s in seqs]
        )
        for seq, token, logprob in zip(seqs, ids, logprobs):
            seq.tokens.append(token)
            seq.generated += 1
            tokens.append(GeneratedToken(seq.request.request_id, token, logprob, self.version))
            params = seq.request.params
            # EOS, then stop tokens, then stop strings, then length: vLLM's order.
            reason, matched = self.stops.check(seq.tokens, seq.generated, params, self.eos_ids)
            if reason is None and (
                seq.generated >= params.max_new_tokens or len(seq.tokens) >= self.max_seq_len
            ):
                reason = "length"
            if reason is not None:
                del self.running[seq.request.request_id]
                self._release(seq)
                finished.append(Finished(seq.request.request_id, reason, seq.generated, matched))
                self.counters.finished += 1
                self.counters.reasons[reason] = self.counters.reasons.get(reason, 0) + 1

    def _flip_when_staged(self, version: int) -> None:
        while True:
            done = self.weights.wait_ready(version)
            self._maybe_flip()
            if done:
                return

    def _maybe_flip(self) -> None:
        version = self.weights.flip()
        if version is None:
            return
        self.version = version
        self.counters.flips += 1
        if self.cfg.flip_policy == "recompute" and self.running:
            # Recompute K/V of every cached token (all but the last) under the new weights.
            self.weights.active.prefill(self.cache, 0, [s.tokens[:-1] for s in self.slots])
            self.counters.recomputed_tokens += sum(len(s.tokens) - 1 for s in self.slots)
