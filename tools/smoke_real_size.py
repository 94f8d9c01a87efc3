"""A real model's size through the whole path, on this machine: SFT, then asynchronous GRPO
with the chat template and the math reward, on a random-init model of a real shape.

    python tools/smoke_real_size.py [--shape qwen2.5-0.5b] [--sft-steps 3] [--rl-steps 3]

Builds what is missing (the model with ``tools/make_model.py``, GSM8K-like data from
reasoning-gym's ``gsm_symbolic`` with ``tools/make_dataset.py``), then runs
``experiments/gsm8k_sft.py`` and ``experiments/gsm8k_grpo.py`` through ``launch/local.py``
with batches small enough for two cores. Every process's peak RSS (the kernel's VmHWM,
read from the pids the launcher records) is sampled while it runs. Ends with one JSON
line: ``{"sft_steps", "rl_steps", "s_per_rl_step", "peak_rss_gb_trainer",
"peak_rss_gb_generator", "publish_s", ...}``; the step and publish times are medians over
the RL steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3


class PeakRss:
    """Samples the peak RSS of each process named in ``RUN_DIR/pids`` every half second."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.peaks = run_dir, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            for pid_file in (self.run_dir / "pids").glob("*.pid"):
                try:
                    pid = pid_file.read_text().split()[0]
                    status = Path(f"/proc/{pid}/status").read_text()
                except (OSError, IndexError):
                    continue  # not started yet, or gone
                for line in status.splitlines():
                    if line.startswith("VmHWM:"):
                        kib = int(line.split()[1])
                        name = pid_file.stem
                        self.peaks[name] = max(self.peaks.get(name, 0), kib * 1024)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {name: round(b / GiB, 2) for name, b in sorted(self.peaks.items())}


def run(cmd: list[str], log: Path) -> None:
    """Run ``cmd`` from the repository root with its output in ``log``; fail loudly."""
    with log.open("w") as out:
        code = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        sys.exit(f"{' '.join(cmd)} failed ({code}); the end of {log}:\n{tail}")


def launch(experiment: str, run_dir: Path, overrides: list[str]) -> tuple[dict, float]:
    """Run one stage; its processes' peak RSS (GiB) and its wall time."""
    run_dir.mkdir(parents=True, exist_ok=True)
    watch, start = PeakRss(run_dir), time.time()
    cmd = [sys.executable, "launch/local.py", experiment, f"run_dir={run_dir}", *overrides]
    run(cmd, run_dir.with_suffix(".log"))
    return watch.stop(), time.time() - start


def trainer_rows(run_dir: Path) -> list[dict]:
    """The trainer's per-step records (SFT's and RL's both carry ``train/loss``)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [r for r in rows if r.get("process") == "trainer" and "train/loss" in r]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--vocab", type=int, default=32000, help="trained BPE vocabulary")
    p.add_argument("--sft-steps", type=int, default=3)
    p.add_argument("--rl-steps", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out", default="runs/smoke_real_size", help="runs, data, exports")
    return p.parse_args(argv)


def make_inputs(args: argparse.Namespace, out: Path) -> tuple[Path, Path]:
    """The model and the data, made where missing; their paths."""
    model, data = out / f"model-{args.shape}", out / "data"
    if not (model / "config.json").is_file():
        make = ["tools/make_model.py", "--shape", args.shape, "--out", str(model)]
        run([sys.executable, *make, "--vocab", str(args.vocab)], out / "make_model.log")
    if not (data / "train.jsonl").is_file():
        make = ["tools/make_dataset.py", "--out", str(data), "--shape", "gsm8k"]
        run([sys.executable, *make, "--train", "200", "--eval", "20"], out / "make_data.log")
    return model, data


def common_overrides(data: Path) -> list[str]:
    # Evaluation off: its engine would hold two more copies of the weights, and a
    # random-init model's accuracy says nothing. One checkpoint, at the end.
    return [
        f"task.train_path={data / 'train.jsonl'}",
        f"task.eval_path={data / 'eval.jsonl'}",
        "eval.num_examples=0",
        "eval.every_steps=0",
        "trainer.checkpoint_every=0",
    ]


def rl_figures(rl_dir: Path, rl_rss: dict[str, float]) -> dict:
    rows = trainer_rows(rl_dir)
    steps = [r["train/step_s"] for r in rows]
    publish = [r["train/weight_publish_s"] for r in rows if "train/weight_publish_s" in r]
    generator = json.loads((rl_dir / "generator_g0_summary.json").read_text())
    return {
        "rl_steps": len(rows),
        # Wall time between consecutive steps (generation, waiting and training), and
        # what the first one took from the launch (model loads, the first batch).
        "s_per_rl_step": round((rows[-1]["time"] - rows[0]["time"]) / (len(rows) - 1), 1)
        if len(rows) > 1
        else None,
        "first_rl_step_s": round(rows[0]["time"], 1) if rows else None,
        "step_s_median": round(statistics.median(steps), 1) if steps else None,
        "peak_rss_gb_trainer": max(v for k, v in rl_rss.items() if k.startswith("trainer")),
        "peak_rss_gb_generator": max(v for k, v in rl_rss.items() if k.startswith("generator")),
        "peak_rss_gb_buffer": rl_rss.get("buffer"),
        # The trainer's blocking part of a publish (the gather and the hand-off to the
        # sending thread); then, on the generator, seconds from a publish's arrival to
        # its weights staged off the decode path and to their use after a decode step
        # (means over the updates).
        "publish_s": round(statistics.median(publish), 2) if publish else None,
        "weight_stage_s": round(generator.get("weight_stage_s", 0.0), 2),
        "weight_flip_s": round(generator.get("weight_flip_s", 0.0), 2),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    model, data = make_inputs(args, out)
    sft_export = out / "sft-export"
    sft_rss, sft_s = launch(
        "experiments/gsm8k_sft.py",
        out / "sft",
        [
            f"model.path={model}",
            f"sft.max_steps={args.sft_steps}",
            "sft.batch_size=4",
            f"sft.export_dir={sft_export}",
            *common_overrides(data),
        ],
    )
    rl_rss, rl_s = launch(
        "experiments/gsm8k_grpo.py",
        out / "grpo",
        [
            f"model.path={sft_export}",
            f"rl.max_steps={args.rl_steps}",
            "buffer.prompts_per_batch=2",
            "buffer.samples_per_prompt=4",
            # A random-init policy's groups are all wrong: dynamic sampling would drop
            # every one of them.
            "buffer.dynamic_sampling=false",
            f"sampling.max_new_tokens={args.max_new_tokens}",
            "engine.embedded.max_slots=8",
            *common_overrides(data),
        ],
    )
    figures = {
        "shape": args.shape,
        "sft_steps": len(trainer_rows(out / "sft")),
        **rl_figures(out / "grpo", rl_rss),
        "peak_rss_gb_sft_trainer": max(sft_rss.values(), default=None),
        "sft_s": round(sft_s, 1),
        "rl_s": round(rl_s, 1),
        "total_s": round(time.time() - start, 1),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
