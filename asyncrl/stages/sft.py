"""Supervised fine-tuning: the first stage of the chain.

Each trainer rank reads the task's train split as a deterministic, resumable stream,
takes its token-balanced share of every global batch, packs it, and steps the FSDP2
trainer core on the masked NLL of the completion tokens. Rank 0 evaluates greedy
held-out accuracy, logs metrics, and exports the final weights as an HF directory that
the RL stages start from. Run it with ``python launch/local.py experiments/tiny_sft.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import ClassVar

import torch

from asyncrl.algorithms.losses import sft_loss
from asyncrl.balance import split_balanced
from asyncrl.config import ConfigError
from asyncrl.episodes.env import check_environment
from asyncrl.episodes.evaluate import episode_accuracy
from asyncrl.evaluation import (
    EvalConfig,
    greedy_accuracy,
    holding_weights,
    make_eval_engine,
    tokenize_prompts,
)
from asyncrl.metrics import MetricsConfig, MetricsLogger
from asyncrl.models import ModelConfig, build_tiny_model, load_tokenizer
from asyncrl.random_models import build_tiny_bpe_model
from asyncrl.stages.common import (
    ProcessSpec,
    out_of_time,
    resume_or_evaluate,
    stage_main,
    trainer_ranks,
)
from asyncrl.tasks import DataError, Example, Task, TaskConfig, build_task, stream_index
from asyncrl.tasks.prompts import PromptRenderer
from asyncrl.trainer.checkpoint import (
    export_hf,
    save_checkpoint,
)
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import StepStats, TrainerCore, barrier
from asyncrl.trainer.dist import DistInfo
from asyncrl.trainer.packing import MicroBatch, TokenSequence, make_micro_batches


@dataclass
class SFTConfig:
    batch_size: int = 64
    """Sequences per optimizer step, over all ranks."""
    max_steps: int = 300
    """Optimizer steps of the stage."""
    export_dir: str = ""
    """Where the final HF checkpoint goes; empty means ``RUN_DIR/hf``."""


@dataclass
class SFTExperiment:
    name: str = "sft"
    """Experiment name; names the default run directory."""
    run_dir: str = ""
    """Run directory (config, logs, metrics, checkpoints); empty means ``runs/NAME-TIME``."""
    seed: int = 0
    """Seed of everything random in the run."""
    time_limit_s: float = 0.0
    """Stop after this many seconds of training (0: no limit); the run still exports."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to fine-tune (a tiny one is built when asked for and missing)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The (prompt, completion) examples: train split to learn, eval split to measure."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer ranks, device, micro-batching and checkpoints."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Batch size, steps and export directory of the stage."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out greedy accuracy: how often and on how many examples."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Logging: TensorBoard, progress bar, cadence."""

    entry: ClassVar[str] = "asyncrl.stages.sft"
    """Module whose ``main`` runs one trainer rank of this stage."""

    def processes(self, config_path: str) -> list[ProcessSpec]:
        """What the launcher starts: the trainer ranks."""
        return trainer_ranks(self, config_path)

    def finalize(self) -> None:
        """Derived values, computed here and nowhere else."""
        if not self.run_dir:
            self.run_dir = f"runs/{self.name}-{datetime.now():%Y%m%d-%H%M%S}"
        if not self.sft.export_dir:
            self.sft.export_dir = str(Path(self.run_dir) / "hf")
        if self.optim.total_steps <= 0:
            self.optim.total_steps = self.sft.max_steps
        try:  # evaluation runs its episodes: a bad environment fails before any process
            check_environment(self.task)
        except ValueError as e:
            raise ConfigError(str(e)) from None


class SFTData:
    """Global batches of tokenized (prompt, completion) pairs from the task's train split,
    reshuffled every epoch (``stream_index``), so resuming needs only the position."""

    def __init__(self, examples: list[Example], renderer: PromptRenderer, seed: int) -> None:
        self.examples, self.renderer, self.seed = examples, renderer, seed
        self._cache: dict[int, TokenSequence] = {}

    def _sequence(self, index: int) -> TokenSequence:
        if index not in self._cache:
            ex = self.examples[index]
            if ex.completion is None:
                raise DataError(f"{ex.uid}: no completion to train on (SFT needs one per row)")
            prompt = self.renderer.prompt_ids(ex)
            completion = self.renderer.completion_ids(ex, ex.completion)
            self._cache[index] = TokenSequence(
                prompt + completion, [0] * len(prompt) + [1] * len(completion)
            )
        return self._cache[index]

    def batch(self, position: int, size: int) -> list[TokenSequence]:
        n = len(self.examples)
        return [
            self._sequence(stream_index(self.seed, p, n)) for p in range(position, position + size)
        ]


def build_model_for_task(path: str | Path, task: Task, cfg: ModelConfig) -> Path:
    """A tiny random-init model whose tokenizer is made from the task's text: characters
    (each one the task has), or a family's BPE trained on it (``cfg.tiny.tokenizer``)."""
    texts = [
        ex.prompt + (ex.completion or "")
        for split in ("train", "eval")
        for ex in task.examples(split)
    ]
    if cfg.tiny.tokenizer != "char":
        return build_tiny_bpe_model(path, texts, cfg.tiny)
    return build_tiny_model(path, texts, cfg.tiny)


def ensure_model(cfg: SFTExperiment, task: Task, info: DistInfo) -> None:
    """Build the tiny model on rank 0 when the experiment asks for it and it is missing."""
    if info.is_main and cfg.model.make_if_missing and not Path(cfg.model.path).exists():
        build_model_for_task(cfg.model.path, task, cfg.model)
    barrier()


class Evaluator:
    """Greedy held-out accuracy on rank 0: the gathered weights go into an embedded engine
    of its own (one plain copy on rank 0's device, beside the shard, while it evaluates)."""

    def __init__(self, cfg: SFTExperiment, task: Task, info: DistInfo) -> None:
        self.cfg, self.task, self.info = cfg, task, info
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.examples = list(task.examples("eval"))[: cfg.eval.num_examples]
        self.engine = None
        if info.is_main and self.examples:
            prompts = tokenize_prompts(self.tokenizer, task.config, self.examples)
            longest = max(len(p) for p in prompts)
            episode = task.config.max_episode_tokens if task.config.environment else None
            self.engine = make_eval_engine(
                cfg.model, cfg.eval, longest, info.device, episode, released=True
            )

    def __call__(self, core: TrainerCore) -> dict[str, float]:
        full = core.full_state_dict()  # a collective: every rank joins
        result: dict[str, float] = {}
        if self.engine is not None:
            e = self.cfg.eval
            score = episode_accuracy if self.task.config.environment else greedy_accuracy
            with holding_weights(self.engine, full, core.step) as engine:
                result = score(
                    engine,
                    self.tokenizer,
                    self.task,
                    self.examples,
                    e.max_new_tokens,
                    stop=e.stop,
                    stop_token_ids=e.stop_token_ids,
                    keep_stop_text=e.keep_stop_text,
                )
        barrier()
        return result


def nll_loss(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
    """The trainer core's ``LossFn`` for SFT: the summed NLL of the completion tokens
    (``logits [rows, T, V]``, ``mb.loss_mask [rows, T]``)."""
    return sft_loss(logits, mb.input_ids, mb.loss_mask)


def my_micro_batches(
    batch: list[TokenSequence], cfg: TrainerConfig, info: DistInfo, pad_id: int
) -> list[MicroBatch]:
    """This rank's token-balanced share of a global batch, packed into micro-batches."""
    mine = split_balanced([len(s) for s in batch], info.world_size)[info.rank]
    return make_micro_batches(
        [batch[i] for i in mine], cfg.micro_batch_tokens, cfg.packing, pad_id, cfg.row_tokens
    )


def run(cfg: SFTExperiment, info: DistInfo) -> dict:
    """One trainer rank of the SFT stage, to ``sft.max_steps`` steps; returns the summary."""
    task = build_task(cfg.task)
    ensure_model(cfg, task, info)
    tokenizer = load_tokenizer(cfg.model.path)
    core = TrainerCore(cfg.model, cfg.trainer, cfg.optim, info, tokenizer.pad_token_id)
    renderer = PromptRenderer.for_task(cfg.task, tokenizer)
    data = SFTData(list(task.examples("train")), renderer, cfg.seed)
    evaluate = Evaluator(cfg, task, info)
    log = MetricsLogger(cfg.run_dir, "trainer", cfg.metrics, info.is_main, cfg.sft.max_steps)
    ckpt_root = Path(cfg.run_dir) / "checkpoints"
    position, accuracy = resume_or_evaluate(
        cfg.trainer.resume, cfg.eval.every_steps, core, ckpt_root, lambda: evaluate(core), log
    )
    initial_accuracy = accuracy.get("eval/accuracy")
    start, stop = time.time(), False
    while core.step < cfg.sft.max_steps and not stop:
        # The RL step's shape: take a batch, take my share, pack, step, log.
        batch = data.batch(position, cfg.sft.batch_size)
        position += cfg.sft.batch_size
        stats = core.train_step(my_micro_batches(batch, cfg.trainer, info, core.pad_id), nll_loss)
        if not stats.skipped:  # a non-finite step changed nothing: the next batch retakes it
            core.step += 1
        stop = out_of_time(start, cfg.time_limit_s, info)
        last = core.step >= cfg.sft.max_steps or stop
        accuracy = log_step(cfg, core, stats, evaluate, log, accuracy, last)
        every = cfg.trainer.checkpoint_every
        if (every and core.step % every == 0) or last:
            save_checkpoint(core, ckpt_root, {"position": position}, cfg.trainer.keep_checkpoints)
    export_hf(core, cfg.sft.export_dir)
    summary = {
        "steps": core.step,
        "train_time_s": round(time.time() - start, 2),
        "initial_eval_accuracy": initial_accuracy,
        "final_eval_accuracy": accuracy.get("eval/accuracy"),
        "export_dir": cfg.sft.export_dir,
    }
    log.write_summary(summary)
    log.close()
    return summary


def log_step(
    cfg: SFTExperiment,
    core: TrainerCore,
    stats: StepStats,
    evaluate: Evaluator,
    log: MetricsLogger,
    accuracy: dict[str, float],
    last: bool,
) -> dict[str, float]:
    """Evaluate when due, log the step's scalars and the progress bar; returns the latest
    evaluation."""
    scalars = {
        "train/loss": stats.loss,
        "train/grad_norm": stats.grad_norm,
        "train/lr": stats.lr,
        "train/tokens_per_s": stats.tokens / stats.seconds,
        "train/skipped_steps": float(stats.skipped),
        **stats.metrics,
    }
    if cfg.eval.every_steps and (core.step % cfg.eval.every_steps == 0 or last):
        accuracy = evaluate(core)
        scalars.update(accuracy)
    if core.step % cfg.metrics.log_every == 0 or last:
        log.log(core.step, scalars)
    shown = {k[5:]: f"{v:.2f}" for k, v in accuracy.items() if k == "eval/accuracy"}
    log.progress(1, {"loss": f"{stats.loss:.3f}", **shown})
    return accuracy


def main(argv: list[str] | None = None) -> None:
    stage_main(run, argv)


if __name__ == "__main__":
    main()
