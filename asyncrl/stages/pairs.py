"""What the two preference stages share: the reward model (``stages/reward_model.py``)
and DPO (``stages/dpo.py``) both train on (prompt, chosen, rejected) pairs.

A stage's pairs come from JSONL files (``PreferenceDataConfig``); when they are missing,
rank 0 makes them first by sampling the starting policy and pairing correct against
incorrect completions by the task's verifier (``stages/preference_data.py``). Each pair
becomes two ``TokenSequence`` (the rendered prompt + completion through its end token,
targets on the completion; ``asyncrl.tasks.prompts``),
placed next to each other: a rank takes a token-balanced share of the pairs of a global
batch, and ``make_micro_batches(group_size=2)`` keeps each pair in one micro-batch, so a
pair's loss reads consecutive sequences (chosen at even, rejected at odd indices). Losses
are normalized by the global pair count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import torch

from asyncrl.balance import split_balanced
from asyncrl.evaluation import EvalConfig
from asyncrl.metrics import MetricsConfig, MetricsLogger
from asyncrl.models import ModelConfig, load_tokenizer
from asyncrl.stages.common import ProcessSpec, out_of_time, resume_or_evaluate, trainer_ranks
from asyncrl.stages.preference_data import PreferenceDataConfig, make_preference_data
from asyncrl.tasks import Example, TaskConfig, stream_index
from asyncrl.tasks.base import DataError
from asyncrl.tasks.jsonl import load_jsonl
from asyncrl.tasks.prompts import PromptRenderer
from asyncrl.trainer.checkpoint import (
    export_hf,
    save_checkpoint,
)
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore, barrier
from asyncrl.trainer.dist import DistInfo, all_reduce_sum
from asyncrl.trainer.packing import MicroBatch, TokenSequence, make_micro_batches

PairLoss = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class PairStageExperiment:
    """Fields of both preference stages; each stage adds its own section and ``entry``."""

    name: str = "pairs"
    """Experiment name; names the default run directory."""
    run_dir: str = ""
    """Run directory (config, logs, metrics, checkpoints); empty means ``runs/NAME-TIME``."""
    seed: int = 0
    """Seed of everything random in the run, and of the pair order."""
    time_limit_s: float = 0.0
    """Stop after this many seconds of training (0: no limit); the run still exports."""
    init_from_experiment: str = ""
    """Experiment file whose output is ``model.path`` (e.g. SFT); the launchers run it
    first when ``model.path`` does not exist."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Where training starts (the SFT policy), and the policy the pairs are sampled from."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task the pairs are made from and held-out accuracy is measured on."""
    data: PreferenceDataConfig = field(default_factory=lambda: PreferenceDataConfig("", ""))
    """The pair files, made from ``model.path`` on ``task`` when missing."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer ranks, device, micro-batching and checkpoints."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """``every_steps`` paces held-out evaluation of the pairs (and of the task, for DPO)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Logging: TensorBoard, progress bar, cadence."""
    batch_size: int = 64
    """Pairs per optimizer step, over all ranks."""
    max_steps: int = 200
    """Optimizer steps of the stage."""
    export_dir: str = ""
    """Where the final HF checkpoint goes; empty means ``RUN_DIR/hf``."""

    def processes(self, config_path: str) -> list[ProcessSpec]:
        """What the launcher starts: the trainer ranks."""
        return trainer_ranks(self, config_path)

    def prerequisites(self) -> list[tuple[str, str]]:
        """(path, experiment file that makes it) pairs the launchers check before starting:
        the starting model, and the policy the pairs come from while the pairs are missing."""
        needs = [(self.model.path, self.init_from_experiment)] if self.init_from_experiment else []
        if self.data.policy and self.data.policy_experiment and not pairs_exist(self.data):
            needs.append((self.data.policy, self.data.policy_experiment))
        return needs

    def finalize(self) -> None:
        """Derived values, computed here and nowhere else."""
        if not self.run_dir:
            self.run_dir = f"runs/{self.name}-{datetime.now():%Y%m%d-%H%M%S}"
        if not self.export_dir:
            self.export_dir = str(Path(self.run_dir) / "hf")
        if not self.data.train_path:
            self.data.train_path = str(Path(self.run_dir) / "data" / "train.jsonl")
        if not self.data.eval_path:
            self.data.eval_path = str(Path(self.run_dir) / "data" / "eval.jsonl")
        if self.optim.total_steps <= 0:
            self.optim.total_steps = self.max_steps


def pairs_exist(data: PreferenceDataConfig) -> bool:
    """Both pair files are there (else the stage makes them first)."""
    return Path(data.train_path).exists() and Path(data.eval_path).exists()


def ensure_pairs(cfg: PairStageExperiment, info: DistInfo) -> None:
    """Make the pair files on rank 0 when either is missing (from the starting policy)."""
    if info.is_main and not pairs_exist(cfg.data):
        started = time.time()
        counts = make_preference_data(cfg.data.policy or cfg.model.path, cfg.task, cfg.data)
        print(f"made preference pairs in {time.time() - started:.0f} s: {counts}", flush=True)
    barrier()


def load_pairs(path: str, task_cfg: TaskConfig | None = None) -> list[Example]:
    """The rows of a pair file: asyncrl's JSONL rows, or, when the task reads dataset
    files (``task.source="dataset"``), a file in the common prompt/chosen/rejected shape
    through the task's field map."""
    if task_cfg is not None and task_cfg.source == "dataset":
        from asyncrl.tasks.dataset import DatasetTask

        return DatasetTask(replace(task_cfg, train_path=path, eval_path=None)).load_file(
            path, "train"
        )
    return load_jsonl(path)


class PairData:
    """The pairs of one file, tokenized: ``(chosen, rejected)`` ``TokenSequence`` each the
    rendered prompt + completion through its end token, targets on the completion."""

    def __init__(
        self, path: str, renderer: PromptRenderer, seed: int, task_cfg: TaskConfig | None = None
    ) -> None:
        self.seed = seed
        self.pairs: list[tuple[TokenSequence, TokenSequence]] = []
        for row in load_pairs(path, task_cfg):
            if row.chosen is None or row.rejected is None:
                line = row.uid.split(":")[1]
                raise DataError(f"{path}:{line}: a preference row needs chosen and rejected")
            if not row.prompt:
                raise DataError(f"{path}:{row.uid.split(':')[1]}: empty prompt")
            prompt = renderer.prompt_ids(row)
            pair = []
            for text in (row.chosen, row.rejected):
                completion = renderer.completion_ids(row, text)
                pair.append(
                    TokenSequence(prompt + completion, [0] * len(prompt) + [1] * len(completion))
                )
            self.pairs.append((pair[0], pair[1]))

    def __len__(self) -> int:
        return len(self.pairs)

    def batch(self, position: int, size: int) -> list[int]:
        """Pair indices at ``position`` of the endless, reshuffled-every-epoch stream."""
        return [
            stream_index(self.seed, p, len(self.pairs)) for p in range(position, position + size)
        ]


def my_pairs(indices: list[int], data: PairData, info: DistInfo) -> list[int]:
    """This rank's token-balanced share of a global batch of pair indices."""
    lengths = [len(data.pairs[i][0]) + len(data.pairs[i][1]) for i in indices]
    return [indices[j] for j in split_balanced(lengths, info.world_size)[info.rank]]


def pair_micro_batches(
    pairs: list[tuple[TokenSequence, TokenSequence]], cfg: TrainerConfig, pad_id: int
) -> list[MicroBatch]:
    """Micro-batches in which every pair sits whole: chosen, then rejected."""
    seqs = [s for pair in pairs for s in pair]
    return make_micro_batches(
        seqs, cfg.micro_batch_tokens, cfg.packing, pad_id, cfg.row_tokens, group_size=2
    )


def split_pairs(
    values: torch.Tensor, mb: MicroBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[S]`` per-sequence values as ``(chosen [P], rejected [P], anchor [])``. ``anchor``
    is 0 with a path to every value, added to a loss so that a micro-batch with no pairs
    (an alignment dummy) still backpropagates, as every FSDP rank must."""
    n = len(mb.seq_lens) // 2 * 2
    return values[0:n:2], values[1:n:2], 0.0 * values.sum()


@torch.no_grad()
def evaluate_pairs(
    core: TrainerCore, micro_batches: list[MicroBatch], loss_fn: PairLoss, local_pairs: int
) -> dict[str, float]:
    """Loss and metrics of held-out pairs under the current weights, averaged over the
    pairs of all ranks (each rank brings its share). Every rank must call it."""
    core.model.eval()
    sums: dict[str, float] = {}
    for mb in core.align(micro_batches):
        mb = mb.to(core.info.device)
        loss, metrics = loss_fn(core.forward(mb), mb)
        for k, v in {"loss": loss, **metrics}.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    core.model.train()
    keys = sorted(sums)
    total, *values = all_reduce_sum(
        [float(local_pairs), *[sums[k] for k in keys]], core.info.device
    )
    out = {}
    for k, v in zip(keys, values):
        name = k.split("/", 1)[-1]
        out[f"eval/pair_{name}"] = v / max(total, 1.0)
    return out


class PairStage:
    """What a preference stage plugs into ``train_on_pairs``."""

    def loss(
        self, logits: torch.Tensor, mb: MicroBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The pair loss of one micro-batch (a sum over its pairs) and metric sums."""
        raise NotImplementedError

    def with_fields(
        self, split: str, indices: list[int]
    ) -> list[tuple[TokenSequence, TokenSequence]]:
        """The pairs ``indices`` of ``split`` with whatever per-token fields ``loss`` reads."""
        raise NotImplementedError

    def evaluate(self, core: TrainerCore) -> dict[str, float]:
        """Held-out figures beyond the pair loss and metrics ({} for none)."""
        return {}


def run_pair_stage(
    cfg: PairStageExperiment,
    info: DistInfo,
    model: ModelConfig,
    make_stage: Callable[[PairData, PairData], PairStage],
) -> dict:
    """One trainer rank of a preference stage: make the pairs if missing, load them, build
    the core on ``model`` and the stage on the (train, held-out) pairs, train."""
    ensure_pairs(cfg, info)
    tokenizer = load_tokenizer(cfg.model.path)
    core = TrainerCore(model, cfg.trainer, cfg.optim, info, tokenizer.pad_token_id)
    renderer = PromptRenderer.for_task(cfg.task, tokenizer)
    data = PairData(cfg.data.train_path, renderer, cfg.seed, cfg.task)
    held_out = PairData(cfg.data.eval_path, renderer, cfg.seed, cfg.task)
    log = MetricsLogger(cfg.run_dir, "trainer", cfg.metrics, info.is_main, cfg.max_steps)
    summary = train_on_pairs(cfg, info, core, make_stage(data, held_out), data, held_out, log)
    log.close()
    return summary


def train_on_pairs(
    cfg: PairStageExperiment,
    info: DistInfo,
    core: TrainerCore,
    stage: PairStage,
    data: PairData,
    held_out: PairData,
    log: MetricsLogger,
) -> dict:
    """The loop of both preference stages: a global batch of pairs, my share, packed in
    whole pairs, one step normalized by the global pair count; periodic held-out
    evaluation, checkpoints, and the HF export at the end. Resumes from the newest
    checkpoint in the run directory."""
    pad_id = core.pad_id
    eval_ids = my_pairs(list(range(len(held_out))), held_out, info)

    def evaluate() -> dict[str, float]:
        micro = pair_micro_batches(stage.with_fields("eval", eval_ids), cfg.trainer, pad_id)
        return evaluate_pairs(core, micro, stage.loss, len(eval_ids)) | stage.evaluate(core)

    ckpt_root = Path(cfg.run_dir) / "checkpoints"
    position, scalars = resume_or_evaluate(
        cfg.trainer.resume, cfg.eval.every_steps, core, ckpt_root, evaluate, log
    )
    initial, start, stop = dict(scalars), time.time(), False
    while core.step < cfg.max_steps and not stop:
        mine = my_pairs(data.batch(position, cfg.batch_size), data, info)
        position += cfg.batch_size
        micro = pair_micro_batches(stage.with_fields("train", mine), cfg.trainer, pad_id)
        stats = core.train_step(micro, stage.loss, local_normalizer=float(len(mine)))
        if not stats.skipped:  # a non-finite step changed nothing: the next batch retakes it
            core.step += 1
        scalars = {
            "train/loss": stats.loss,
            "train/grad_norm": stats.grad_norm,
            "train/lr": stats.lr,
            "train/tokens_per_s": stats.tokens / stats.seconds,
            **stats.metrics,
        }
        stop = out_of_time(start, cfg.time_limit_s, info)
        last = core.step >= cfg.max_steps or stop
        if cfg.eval.every_steps and (core.step % cfg.eval.every_steps == 0 or last):
            scalars |= evaluate()
        log.log(core.step, scalars)
        log.progress(1, {"loss": f"{stats.loss:.3f}"})
        every = cfg.trainer.checkpoint_every
        if (every and core.step % every == 0) or last:
            save_checkpoint(core, ckpt_root, {"position": position}, cfg.trainer.keep_checkpoints)
    export_hf(core, cfg.export_dir)
    final = {k: v for k, v in scalars.items() if k.startswith("eval/")}
    summary = {
        "steps": core.step,
        "train_time_s": round(time.time() - start, 2),
        "initial": {k: v for k, v in initial.items() if k.startswith("eval/")},
        "final": final,
        "export_dir": cfg.export_dir,
    }
    log.write_summary(summary)
    return summary
