"""Replaying a finished asynchronous run (``tools/replay.py``): its trainer again, on
exactly the batches it trained on, and its samples again, from their versions' weights.

The batches come from the buffer's write-ahead log (``asyncrl.loop.recorded``,
``RecordedRun``), the replayed trainer's ``BatchSource``: ``asyncrl.stages.rl.run``,
publishing to nobody. On the same machine and thread count the trainer's arithmetic is
the same, so its weights come out bit for bit.

``regenerate`` decodes recorded samples again with the weights of the version that
sampled them (the starting model, or a checkpoint of that step), each with its own seed
(``asyncrl.seeds``), and compares the tokens.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.config import load_json
from asyncrl.engine.base import Request
from asyncrl.engine.leases import sampling_params
from asyncrl.loop.recorded import RecordedRun, checkpoint_weights
from asyncrl.seeds import derive_seed
from asyncrl.stages.common import stage_main
from asyncrl.stages.rl import run
from asyncrl.wire import Sample


def recorded_run(run_dir: str | Path, rank: int | None = None) -> RecordedRun:
    """The batches the run in ``run_dir`` served its trainer rank ``rank`` (all: None),
    rebuilt with the run's own config."""
    return RecordedRun(run_dir, load_json(Path(run_dir) / "config.json").rollout(), rank)


@dataclass
class Regenerated:
    checked: int = 0
    equal: int = 0
    mismatches: list[str] = field(default_factory=list)
    """The first few samples whose tokens differ (group, index, version)."""
    versions: dict[int, int] = field(default_factory=dict)
    """Samples decoded again, by version."""


def single_version(sample: Sample) -> tuple[int, int] | None:
    """(prompt length, version) of a single-turn sample whose tokens one version sampled."""
    generated = [i for i, v in enumerate(sample.versions) if v >= 0]
    if not generated or generated != list(range(generated[0], len(sample.versions))):
        return None
    versions = {sample.versions[i] for i in generated}
    return (generated[0], versions.pop()) if len(versions) == 1 else None


def regenerate(
    run_dir: Path, samples: list[Sample], weights: dict[int, Path | None], limit: int
) -> Regenerated:
    """Decode up to ``limit`` recorded single-version samples again (spread over the
    versions), each with its own seed and its version's weights: ``weights[version]``, a
    checkpoint directory, or None for the starting model (versions not in it were not
    kept); counts those whose tokens all match."""
    from asyncrl.engine.embedded import EmbeddedEngine  # the tool's side only
    from asyncrl.evaluation import decode_all

    cfg = load_json(run_dir / "config.json")
    why_not = not_regenerable(cfg)
    if why_not:
        print(f"[replay] samples not decoded again: {why_not}")
        return Regenerated()
    by_version: dict[int, list[tuple[int, Sample]]] = {}
    for s in samples:
        found = single_version(s)
        if found is not None:
            by_version.setdefault(found[1], []).append((found[0], s))
    out = Regenerated()
    engine = EmbeddedEngine(cfg.model.path, cfg.engine.embedded)
    spec = cfg.sampling.spec(cfg.seed)
    kept = [v for v in sorted(by_version) if v in weights]
    try:
        for n, version in enumerate(kept):
            if weights[version] is not None:  # None: the starting model, already loaded
                engine.stage_weights(checkpoint_weights(weights[version]), version, wait=True)
            share = (limit - out.checked) // (len(kept) - n)  # spread over the versions kept
            todo = by_version[version][:share]
            requests = []
            for k, (start, s) in enumerate(todo):
                seed = derive_seed(cfg.seed, s.group_id, s.sample_index)
                if not cfg.engine.plan().embedded:  # the front's, keyed by the attempt
                    seed = derive_seed(seed, start)
                params = sampling_params(spec, spec.max_new_tokens, seed)
                requests.append(Request(str(k), s.token_ids[:start], params))
            produced, _ = decode_all(engine, requests)
            for (start, s), tokens in zip(todo, produced):
                out.checked += 1
                out.versions[version] = out.versions.get(version, 0) + 1
                if tokens == s.token_ids[start:]:
                    out.equal += 1
                elif len(out.mismatches) < 5:
                    out.mismatches.append(f"group {s.group_id} sample {s.sample_index} v{version}")
    finally:
        engine.close()
    return out


def not_regenerable(cfg) -> str:
    """Why the run's samples cannot be decoded again by the embedded engine, or ""."""
    if not cfg.sampling.seeded:
        return "the run sampled unseeded (sampling.seeded=false)"
    if cfg.task.environment:
        return "episodes: their turns' budgets and observations are the environment's"
    plan = cfg.engine.plan()
    if plan.own_sampler:
        return f"the run sampled on {plan.server} servers, with their own sampler"
    return ""


def main(argv: list[str] | None = None) -> None:
    """One trainer rank of a replay: ``--config`` the replay's, ``--source`` the run."""
    parser = argparse.ArgumentParser(description="Replay a run's trainer on its batches.")
    parser.add_argument("--source", required=True, help="the recorded run's directory")
    args, rest = parser.parse_known_args(argv)
    stage_main(lambda cfg, info: run(cfg, info, recorded_run(args.source, info.rank)), rest)


if __name__ == "__main__":
    main()
