"""The colocated placement: one process generates, then trains, through the same RL code.

In process: the rollout hands over whole groups made only by the current version's weights
(staleness 0, even though the experiment asks for η = 2), and their behavior logprobs
are what the trainer core recomputes with those weights, before and after a real update;
a resumed run's fresh buffer admits only the current step's prompts.
Through the launcher: a short run advances its steps in a single process.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch

from asyncrl.buffer.config import BufferConfig
from asyncrl.buffer.core import RolloutBuffer
from asyncrl.buffer.rewards import RewardConfig
from asyncrl.config import ConfigError
from asyncrl.engine.config import EngineConfig
from asyncrl.engine.embedded import EmbeddedEngineConfig
from asyncrl.engine.leases import SamplingConfig
from asyncrl.logprobs import token_logprobs
from asyncrl.loop.batch import to_sequences
from asyncrl.loop.colocated import ColocatedRollout
from asyncrl.metrics import MetricsConfig, read_metrics
from asyncrl.models import ModelConfig, load_tokenizer
from asyncrl.stages.rl import RLExperiment
from asyncrl.tasks import TaskConfig
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.packing import make_micro_batches
from asyncrl.wire import SamplingSpec
from tests.runs import short_grpo_command

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, GROUP = 3, 4


def _experiment(model_dir: str, run_dir: Path) -> RLExperiment:
    cfg = RLExperiment(
        run_dir=str(run_dir),
        placement="colocated",
        model=ModelConfig(path=model_dir),
        task=TaskConfig(train_size=200, eval_size=8),
        # η = 2 would let prompts of later steps start on old weights; colocated forces 0.
        buffer=BufferConfig(prompts_per_batch=PROMPTS, samples_per_prompt=GROUP, max_staleness=2),
        sampling=SamplingConfig(max_new_tokens=6, temperature=0.8),
        reward=RewardConfig(workers=0),
        # Fewer slots than a batch's samples: groups go through the engine in several waves.
        engine=EngineConfig(embedded=EmbeddedEngineConfig(max_slots=5, max_seq_len=64, threads=1)),
        optim=OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant"),
        metrics=MetricsConfig(tensorboard=False, progress_bar=False),
    )
    cfg.finalize()
    return cfg


def _recompute(core: TrainerCore, micro, temperature: float) -> list[torch.Tensor]:
    """The trainer's proximal logprobs of every loss token, per micro-batch."""
    with torch.no_grad():
        return [
            token_logprobs(core.forward(mb), mb.input_ids, temperature)[mb.loss_mask.bool()]
            for mb in micro
        ]


def _likelihood_loss(logits, mb):
    """Raise the likelihood of the sampled tokens: any real update will do here."""
    logp = token_logprobs(logits, mb.input_ids, 0.8)
    return -(logp * mb.loss_mask).sum(), {}


def test_colocated_rollout_is_on_policy_with_the_trainers_logprobs(
    dist_info, tiny_model_dir, tmp_path
):
    cfg = _experiment(tiny_model_dir, tmp_path / "run")
    assert cfg.buffer.max_staleness == 0
    pad = load_tokenizer(tiny_model_dir).pad_token_id
    core = TrainerCore(cfg.model, cfg.trainer, cfg.optim, dist_info, pad)
    rollout = ColocatedRollout(cfg.rollout(), cfg.colocated_threads(), dist_info)
    try:
        rollout.announce_version(0)
        for step in range(3):
            batch = rollout.request_batch(step, 1)
            assert batch.step == step
            assert rollout.engine.memory_bytes == 0  # weights and cache given to the trainer
            sizes = Counter(s.group_id for s in batch.samples)
            assert len(sizes) == PROMPTS and set(sizes.values()) == {GROUP}  # whole groups
            for s in batch.samples:
                generated = [v for v, m in zip(s.versions, s.loss_mask) if m]
                assert generated and set(generated) == {step}  # staleness 0
            micro = make_micro_batches(
                to_sequences(batch.samples, cfg.rl, cfg.completion_cap()),
                cfg.trainer.micro_batch_tokens,
                cfg.trainer.packing,
                pad,
                cfg.trainer.row_tokens,
            )
            behavior = [mb.fields["behavior"][mb.loss_mask.bool()] for mb in micro]
            before = _recompute(core, micro, cfg.sampling.temperature)
            for b, p in zip(behavior, before):
                torch.testing.assert_close(p, b, atol=1e-4, rtol=0)
            core.train_step(micro, _likelihood_loss)
            after = _recompute(core, micro, cfg.sampling.temperature)
            # The update really moves the policy, so stale weights in the engine would show.
            assert max((a - b).abs().max().item() for a, b in zip(after, before)) > 1e-2
            assert rollout.publish(step + 1, core.full_parameters()) >= 0.0
            assert rollout.engine.cache is not None  # taken back, with the new weights
            rollout.announce_version(step + 1)
        assert rollout.engine.version == 3
        assert dict(rollout.buffer.state.staleness) == {0: 3 * PROMPTS * GROUP}
        rollout.buffer.check_accounting()
    finally:
        rollout.close()
    records = [r for r in read_metrics(tmp_path / "run") if r["process"] == "colocated"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["colocated/generate_s"] > 0 and r["colocated/train_s"] > 0 for r in records)
    assert all(r["colocated/tokens_per_s"] > 0 for r in records)
    counters = json.loads((tmp_path / "run" / "buffer_counters.json").read_text())
    assert counters["buffer/samples_consumed"] == 3 * PROMPTS * GROUP


def test_a_resumed_buffer_admits_only_the_current_steps_prompts():
    """A colocated run resuming at version 5 keeps no buffer state: ``start_at`` makes the
    gate admit step 5's prompts only, from where the stream would be, not steps 0-5's."""
    cfg = BufferConfig(prompts_per_batch=PROMPTS, samples_per_prompt=GROUP, max_staleness=0)
    buffer = RolloutBuffer(cfg, "run", lambda i: (i, [1, 2, i]), SamplingSpec())
    buffer.batches.start_at(5)
    leases = buffer.leases.lease("colocated", 1000, now=0.0)
    assert len(leases) == PROMPTS * GROUP
    assert sorted({lease.prompt_id for lease in leases}) == [15, 16, 17]
    with pytest.raises(RuntimeError):
        buffer.batches.start_at(6)  # only a buffer that has issued nothing can be moved


def test_colocated_rejects_several_ranks(tiny_model_dir, tmp_path):
    cfg = RLExperiment(
        run_dir=str(tmp_path), placement="colocated", trainer=TrainerConfig(num_ranks=2)
    )
    with pytest.raises(ConfigError, match="num_ranks"):
        cfg.finalize()


def test_colocated_says_it_sets_the_staleness_bound_to_zero(tmp_path, caplog):
    cfg = RLExperiment(run_dir=str(tmp_path), placement="colocated")
    cfg.buffer.max_staleness = 2
    with caplog.at_level("WARNING"):
        cfg.finalize()
    assert cfg.buffer.max_staleness == 0
    assert "buffer.max_staleness=2 becomes 0" in caplog.text
    caplog.clear()
    cfg.finalize()  # already 0: nothing to say
    assert "max_staleness" not in caplog.text


def test_launcher_runs_tiny_grpo_colocated(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    cmd = short_grpo_command(
        run_dir, tiny_model_dir, "placement=colocated", "rl.max_steps=3", "rl.overlong_filter=true"
    )
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    metrics = read_metrics(run_dir)
    trained = [r for r in metrics if r["process"] == "trainer" and "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert all(math.isfinite(r["train/loss"]) for r in trained)
    # The step's completion lengths, and the truncated samples the overlong filter dropped.
    for r in trained:
        assert r["length/samples"] == 2 * 4
        assert 1 <= r["length/p50"] <= r["length/p90"] <= r["length/p99"] <= r["length/max"]
        truncated = r["length/truncated_frac"] * r["length/samples"]
        assert r["train/overlong_filtered_samples"] == pytest.approx(truncated)
    phases = [r for r in metrics if r["process"] == "colocated"]
    assert [r["step"] for r in phases] == [1, 2, 3]
    counters = json.loads((run_dir / "buffer_counters.json").read_text())
    assert counters["buffer/samples_consumed"] == 3 * 2 * 4
    assert {k for k in counters if k.startswith("buffer/staleness_")} == {"buffer/staleness_0"}
    # One process: no buffer, no generators, no rollout config for them.
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["trainer_0.log"]
    assert not (run_dir / "rollout.json").exists()
