"""Peer comparison: TRL's ``GRPOTrainer`` on the default experiment's task, model,
starting checkpoint and machine, with the same held-out evaluation, timed to the same
accuracy targets. TRL is a benchmark-only dependency (``pip install -e ".[bench]"``).

    python tools/trl_grpo.py [--experiment experiments/tiny_grpo.py] [--time-limit 600]

Matched to the experiment: the policy (``model.path``, the tiny_sft export), the RL
prompts (``task.rl_split``) and verifier reward (full marks only), 64 prompts × 4
samples per step, temperature, completion budget, learning rate and warmup, clip range
(ε_low, ε_high), token-level loss, no KL. Not matched: TRL has no dynamic-sampling
filter (groups whose samples all got the same reward stay in the batch with zero
advantage; it logs their share as ``frac_reward_zero_std``). TRL runs generation and training in turn in one
process on every core (``transformers`` generate), as its CPU path does: the shape of
asyncrl's colocated placement. Every ``eval.every_steps`` steps a callback measures greedy
accuracy on the same 200 held-out problems with asyncrl's evaluation engine, counted in
the wall time as it is in asyncrl's runs. Ends by printing one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.evaluation import greedy_accuracy, make_eval_engine, tokenize_prompts  # noqa: E402
from asyncrl.launcher.prepare import resolve  # noqa: E402
from asyncrl.models import load_tokenizer  # noqa: E402
from asyncrl.report import accuracy_at  # noqa: E402
from asyncrl.tasks import build_task  # noqa: E402


def first_reaching(points: list[tuple[float, int, float]], target: float) -> dict | None:
    """(seconds, step) of the first evaluation at or above ``target``, or None."""
    for seconds, step, accuracy in points:
        if accuracy >= target - 1e-9:
            return {"s": round(seconds, 1), "step": step}
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experiment", default="experiments/tiny_grpo.py")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds of training")
    parser.add_argument("--targets", type=float, nargs="*", default=[0.5, 0.55, 0.6])
    parser.add_argument("--out", default="runs/trl_grpo", help="TRL's output directory")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: every core")
    return parser.parse_args(argv)


def grpo_config(cfg: Any, out: str) -> Any:
    """TRL's ``GRPOConfig`` matched to the experiment ``cfg`` (see the module docstring)."""
    from trl import GRPOConfig

    n = cfg.buffer.samples_per_prompt
    per_step = cfg.buffer.prompts_per_batch * n
    return GRPOConfig(
        output_dir=out,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        seed=cfg.seed,
        max_steps=cfg.rl.max_steps,
        logging_steps=10,
        disable_dropout=True,
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        num_generations=n,
        generation_batch_size=per_step,
        num_iterations=1,
        max_completion_length=cfg.sampling.max_new_tokens,
        temperature=cfg.sampling.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=cfg.optim.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=cfg.optim.warmup_steps,
        adam_beta1=cfg.optim.beta1,
        adam_beta2=cfg.optim.beta2,
        weight_decay=cfg.optim.weight_decay,
        max_grad_norm=cfg.optim.max_grad_norm,
        beta=0.0,
        loss_type="dapo",
        epsilon=cfg.rl.loss.clip_low,
        epsilon_high=cfg.rl.loss.clip_high,
        scale_rewards="group",
        remove_unused_columns=False,
    )


class Evaluator:
    """Greedy accuracy of the live TRL model on the held-out problems, with asyncrl's
    evaluation engine; ``points`` are (seconds since ``start``, step, accuracy)."""

    def __init__(self, cfg: Any, model: Any, tokenizer: Any, task: Any, held_out: list) -> None:
        self.cfg, self.model, self.tokenizer, self.task = cfg, model, tokenizer, task
        self.held_out = held_out
        prompt_len = max(len(p) for p in tokenize_prompts(tokenizer, task.config, held_out))
        self.engine = make_eval_engine(cfg.model, cfg.eval, prompt_len, torch.device("cpu"))
        self.points: list[tuple[float, int, float]] = []
        self.start = time.time()

    def __call__(self, step: int) -> None:
        weights = {k: v.detach() for k, v in self.model.state_dict().items()}
        self.engine.load_weights(weights, step)
        accuracy = greedy_accuracy(
            self.engine, self.tokenizer, self.task, self.held_out, self.cfg.eval.max_new_tokens
        )["eval/accuracy"]
        self.points.append((time.time() - self.start, step, accuracy))
        print(
            f"[trl] step {step} t={time.time() - self.start:.0f}s accuracy {accuracy:.3f}",
            flush=True,
        )

    def restart_clock(self) -> None:
        """The clock starts after the first evaluation, as asyncrl's RL stage's does."""
        self.start, self.points[0] = time.time(), (0.0, 0, self.points[0][2])


def evaluate_callback(evaluate: Evaluator, every_steps: int, time_limit: float) -> Any:
    """A ``TrainerCallback`` that evaluates every ``every_steps`` steps and stops training
    once ``time_limit`` seconds have passed on the evaluator's clock."""
    from transformers import TrainerCallback

    class Evaluate(TrainerCallback):
        def on_step_end(self, _args, state, control, **_):
            if state.global_step % every_steps == 0:
                evaluate(state.global_step)
            if time.time() - evaluate.start > time_limit:
                control.should_training_stop = True
            return control

    return Evaluate()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    cfg = resolve(args.experiment, [f"run_dir={args.out}"])
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    task = build_task(cfg.task)
    examples = task.examples(cfg.task.rl_split)
    held_out = list(task.examples("eval"))[: cfg.eval.num_examples]
    tokenizer = load_tokenizer(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    dataset = Dataset.from_dict(
        {"prompt": [e.prompt for e in examples], "index": list(range(len(examples)))}
    )

    def verifier(prompts, completions, index, **_) -> list[float]:
        # the buffer's reward: full marks only (task.full_marks_only), on the decoded text
        return [
            1.0 if task.score(examples[i], c) >= 1.0 - 1e-6 else 0.0
            for c, i in zip(completions, index)
        ]

    trl_cfg = grpo_config(cfg, args.out)
    evaluate = Evaluator(cfg, model, tokenizer, task, held_out)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=verifier,
        args=trl_cfg,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[evaluate_callback(evaluate, cfg.eval.every_steps, args.time_limit)],
    )
    evaluate(0)
    evaluate.restart_clock()
    trainer.train()
    steps = trainer.state.global_step
    if not evaluate.points or evaluate.points[-1][1] != steps:
        evaluate(steps)
    per_step = cfg.buffer.prompts_per_batch * cfg.buffer.samples_per_prompt
    result = summarize(args, steps, per_step, evaluate.points, time.time() - evaluate.start)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "evals.json").write_text(json.dumps(evaluate.points))
    print(json.dumps(result))
    return 0


def summarize(
    args: argparse.Namespace,
    steps: int,
    per_step: int,
    points: list[tuple[float, int, float]],
    wall: float,
) -> dict[str, Any]:
    """The JSON line: throughput over the wall time and accuracy against time."""
    return {
        "trainer": "trl.GRPOTrainer",
        "experiment": args.experiment,
        "steps": steps,
        "wall_s": round(wall, 1),
        "steps_per_s": round(steps / wall, 3),
        "trained_samples_per_s": round(steps * per_step / wall, 1),
        "accuracy_at_min": accuracy_at([(t, a) for t, _, a in points], [0, 2, 5, 10]),
        "s_to_target": {str(t): first_reaching(points, t) for t in args.targets},
        "final_accuracy": points[-1][2],
    }


if __name__ == "__main__":
    sys.exit(main())
