"""Online RL, the asynchronous core (DESIGN §4–§6): the trainer ranks' side.

Each rank asks the buffer for its share of step i's batch (whole groups, staleness
checked), turns group rewards into advantages, recomputes proximal logprobs with the
weights at the start of the step, takes one decoupled-PPO step on the FSDP2 core, and
rank 0 publishes the new weights as version i+1 (raw ZeroMQ frames to every generator)
and announces the version to the buffer. The buffer and generator processes are started
by the launcher from ``rollout()``; ``max_staleness=0`` is the synchronous baseline
through this same code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import ClassVar, Literal

import torch
import zmq

from asyncrl.algorithms.advantages import grpo_advantages, overlong_penalty, rloo_advantages
from asyncrl.algorithms.losses import PPOLossConfig, ppo_loss, token_entropy
from asyncrl.buffer.client import BufferClient
from asyncrl.buffer.core import BufferConfig
from asyncrl.buffer.rewards import RewardConfig
from asyncrl.config import save_json
from asyncrl.engine.embedded import EngineConfig
from asyncrl.evaluation import EvalConfig
from asyncrl.metrics import MetricsConfig, MetricsLogger
from asyncrl.models import ModelConfig, load_model, load_tokenizer
from asyncrl.rollout import RolloutConfig, SamplingConfig
from asyncrl.stages.common import ProcessSpec, out_of_time, stage_main, trainer_ranks
from asyncrl.stages.sft import Evaluator
from asyncrl.tasks import TaskConfig, build_task
from asyncrl.trainer.checkpoint import (
    export_hf,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.dist import DistInfo
from asyncrl.trainer.logprobs import token_logprobs
from asyncrl.trainer.packing import TokenSequence, make_micro_batches
from asyncrl.transport import TransportConfig, bind, make_socket, write_endpoints
from asyncrl.wire import Sample, encode_tensors


@dataclass
class RLConfig:
    algorithm: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """Advantage estimator: GRPO, Dr.GRPO (no std scaling) or RLOO."""
    max_steps: int = 100
    """Optimizer steps (= published versions) of the run."""
    overlong_cache: int = 0
    """DAPO overlong shaping over this many tokens before ``max_new_tokens`` (0: off)."""
    export_dir: str = ""
    """Write the final policy as an HF directory here; empty means ``RUN_DIR/hf``."""
    loss: PPOLossConfig = field(default_factory=PPOLossConfig)


@dataclass
class RLExperiment:
    name: str = "rl"
    """Experiment name; names the default run directory."""
    run_dir: str = ""
    """Run directory; empty means ``runs/NAME-TIME``."""
    seed: int = 0
    """Seed of everything random in the run."""
    time_limit_s: float = 0.0
    """End the run after this many seconds of training (0: no limit)."""
    num_generators: int = 1
    """Generator processes."""
    init_from_experiment: str = ""
    """Experiment file whose run writes ``model.path``; the launcher runs it first when
    that directory is missing (e.g. SFT before RL)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to start from (generators load the same directory)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    entry: ClassVar[str] = "asyncrl.stages.rl"

    def finalize(self) -> None:
        """Derived values, computed here and nowhere else."""
        if not self.run_dir:
            self.run_dir = f"runs/{self.name}-{datetime.now():%Y%m%d-%H%M%S}"
        if self.optim.total_steps <= 0:
            self.optim.total_steps = self.rl.max_steps
        if not self.rl.export_dir:
            self.rl.export_dir = str(Path(self.run_dir) / "hf")

    def processes(self, config_path: str) -> list[ProcessSpec]:
        """The buffer, the generators (restarted when they die) and the trainer ranks."""
        rollout_path = str(Path(config_path).with_name("rollout.json"))
        save_json(self.rollout(), rollout_path)
        threads = max(1, self.engine.threads)
        procs = [ProcessSpec("buffer", "asyncrl.buffer.server", ["--config", rollout_path])]
        procs += [ProcessSpec(f"generator_{i}", "asyncrl.generator.worker",
                              ["--config", rollout_path, "--worker-id", f"g{i}"], restartable=True, threads=threads)
                  for i in range(self.num_generators)]  # fmt: skip
        return procs + trainer_ranks(self, config_path)

    @property
    def run_id(self) -> str:
        return Path(self.run_dir).name

    def rollout(self) -> RolloutConfig:
        """The config the buffer and generator processes read."""
        return RolloutConfig(run_dir=self.run_dir, run_id=self.run_id, seed=self.seed, model=self.model,
                             task=self.task, buffer=self.buffer, sampling=self.sampling, reward=self.reward,
                             transport=self.transport, engine=self.engine)  # fmt: skip


def to_sequences(samples: list[Sample], cfg: RLExperiment) -> list[TokenSequence]:
    """Trajectories to training sequences with per-token behavior logprobs and advantages.

    Samples arrive as whole groups (the buffer keeps a group on one rank), in group order.
    """
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    out = []
    for members in groups.values():
        rewards = torch.tensor([[s.reward for s in members]], dtype=torch.float32)
        if cfg.rl.overlong_cache:
            lengths = torch.tensor([sum(s.loss_mask) for s in members])
            rewards = (
                rewards
                + overlong_penalty(lengths, cfg.sampling.max_new_tokens, cfg.rl.overlong_cache)[
                    None
                ]
            )
        if cfg.rl.algorithm == "rloo":
            adv = rloo_advantages(rewards)[0]
        else:
            adv = grpo_advantages(rewards, scale_by_std=cfg.rl.algorithm == "grpo")[0]
        for s, a in zip(members, adv.tolist()):
            out.append(TokenSequence(s.token_ids, s.loss_mask, {
                "behavior": s.logprobs, "advantages": [a * m for m in s.loss_mask],
            }))  # fmt: skip
    return out


class WeightPublisher:
    """Rank 0's PUB socket: every generator receives each published version."""

    def __init__(self, cfg: RLExperiment) -> None:
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.PUB, cfg.transport)
        endpoint = bind(self.sock, cfg.transport, cfg.run_dir, "trainer-weights")
        write_endpoints(cfg.run_dir, "trainer", {"weights": endpoint})
        self.run_id = cfg.run_id

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> float:
        start = time.perf_counter()
        self.sock.send_multipart(encode_tensors(version, self.run_id, state), copy=False)
        return time.perf_counter() - start

    def close(self) -> None:
        self.ctx.destroy(linger=1000)


def run(cfg: RLExperiment, info: DistInfo) -> dict:
    task = build_task(cfg.task)
    tokenizer = load_tokenizer(cfg.model.path)
    core = TrainerCore(cfg.model, cfg.trainer, cfg.optim, info, tokenizer.pad_token_id)
    evaluate = Evaluator(cfg, task, info)
    publisher = WeightPublisher(cfg) if info.is_main else None
    client = BufferClient(cfg.run_dir, cfg.run_id, info.rank, cfg.transport)
    log = MetricsLogger(cfg.run_dir, "trainer", cfg.metrics, info.is_main, cfg.rl.max_steps)
    ckpt_root = Path(cfg.run_dir) / "checkpoints"
    resume_from = latest_checkpoint(ckpt_root) if cfg.trainer.resume else None
    accuracy = {} if resume_from else evaluate(core)
    if resume_from is not None:
        load_checkpoint(core, resume_from)
    initial = accuracy.get("eval/accuracy")
    if accuracy:
        log.log(core.step, accuracy)
    if publisher is not None and core.step > 0:  # generators start from model.path (version 0)
        publisher.publish(core.step, core.full_state_dict())
    elif core.step > 0:
        core.full_state_dict()
    if info.is_main:
        client.announce_version(core.step)
    start, stop, temperature = time.time(), False, max(cfg.sampling.temperature, 1e-6)
    # A frozen, unsharded copy of the starting policy on every rank when the loss has a KL term.
    reference = load_model(cfg.model, info.device).eval() if cfg.rl.loss.kl_coef else None

    def loss_fn(logits, mb):
        f = mb.fields
        if "proximal" not in f:  # padding micro-batch of a rank that got no samples
            return logits.sum() * 0.0, {}
        logp = token_logprobs(logits, mb.input_ids, temperature)
        entropy = token_entropy(logits, temperature) if cfg.rl.loss.entropy_coef else None
        return ppo_loss(logp, f["proximal"], f["behavior"], f["advantages"], mb.loss_mask, cfg.rl.loss,
                        ref_logprobs=f.get("reference"), entropy=entropy)  # fmt: skip

    while core.step < cfg.rl.max_steps and not stop:
        # 1. my share of this step's batch (whole groups, at most max_staleness old)
        wait = time.perf_counter()
        batch = client.request_batch(core.step, info.world_size)
        waited = time.perf_counter() - wait
        micro = make_micro_batches(to_sequences(batch.samples, cfg), cfg.trainer.micro_batch_tokens,
                                   cfg.trainer.packing, tokenizer.pad_token_id, cfg.trainer.row_tokens)  # fmt: skip
        # 2. proximal logprobs: the weights at the start of this step, no grad
        with torch.no_grad():
            for mb in core.align(micro):
                moved = mb.to(info.device)
                mb.fields["proximal"] = token_logprobs(
                    core.forward(moved), moved.input_ids, temperature
                ).cpu()
                if reference is not None:  # frozen starting policy, for the KL term
                    ref_logits = reference(
                        input_ids=moved.input_ids,
                        position_ids=moved.position_ids,
                        attention_mask=moved.attention_mask,
                        use_cache=False,
                    ).logits
                    mb.fields["reference"] = token_logprobs(
                        ref_logits, moved.input_ids, temperature
                    ).cpu()
        # 3. one decoupled-PPO step
        stats = core.train_step(micro, loss_fn)
        # 4. publish version v+1 to the generators and announce it to the buffer
        state = core.full_state_dict()
        sync_s = publisher.publish(core.step, state) if publisher is not None else 0.0
        if info.is_main:
            client.announce_version(core.step)
        rewards = [s.reward for s in batch.samples]
        scalars = {"train/loss": stats.loss, "train/grad_norm": stats.grad_norm, "train/lr": stats.lr,
                   "train/tokens_per_s": stats.tokens / stats.seconds, "train/wait_for_batch_s": waited,
                   "train/weight_publish_s": sync_s, "rollout/reward": sum(rewards) / max(len(rewards), 1),
                   **stats.metrics}  # fmt: skip
        stop = out_of_time(start, cfg.time_limit_s, info)
        last = core.step >= cfg.rl.max_steps or stop
        if cfg.eval.every_steps and (core.step % cfg.eval.every_steps == 0 or last):
            accuracy = evaluate(core)
            scalars.update(accuracy)
        log.log(core.step, scalars)
        postfix = {"reward": f"{scalars['rollout/reward']:.2f}"}
        if "eval/accuracy" in accuracy:
            postfix["acc"] = f"{accuracy['eval/accuracy']:.2f}"
        log.progress(1, postfix)
        every = cfg.trainer.checkpoint_every
        if (every and core.step % every == 0) or last:
            save_checkpoint(core, ckpt_root, {}, cfg.trainer.keep_checkpoints)
    if cfg.rl.export_dir:
        export_hf(core, cfg.rl.export_dir)
    summary = {"steps": core.step, "train_time_s": round(time.time() - start, 2),
               "initial_eval_accuracy": initial, "final_eval_accuracy": accuracy.get("eval/accuracy"),
               "export_dir": cfg.rl.export_dir}  # fmt: skip
    log.write_summary(summary)
    log.close()
    client.close()
    if publisher is not None:
        publisher.close()
    return summary


def main(argv: list[str] | None = None) -> None:
    stage_main(run, argv)


if __name__ == "__main__":
    main()
