"""Metrics: TensorBoard scalars, the same scalars appended to ``RUN_DIR/metrics.jsonl``,
``RUN_DIR/summary.json`` at the end (generators also write ``generator_<id>_summary.json``),
and a progress bar on the terminal. ``tools/run_report.py`` reads them back into figures.

Every process writes its own TensorBoard subdirectory (``tb/<process>``) and tags its
jsonl lines with the process name, so one run directory holds them all. Metric names are
namespaced: ``train/loss``, ``eval/accuracy``, ``rollout/tokens_per_s``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm


@dataclass
class MetricsConfig:
    tensorboard: bool = True
    """Write TensorBoard event files under ``RUN_DIR/tb``."""
    log_every: int = 1
    """Log scalars every this many steps."""
    progress_bar: bool = True
    """Show a progress bar (on stderr) for long work."""
    interval_s: float = 5.0
    """Processes that log on a clock rather than per step (generators) log this often."""


class MetricsLogger:
    """Scalars of one process; a no-op when ``enabled`` is false (non-main ranks)."""

    def __init__(
        self,
        run_dir: str | Path,
        process: str,
        cfg: MetricsConfig,
        enabled: bool = True,
        total_steps: int | None = None,
    ) -> None:
        self.enabled = enabled
        self.process = process
        self.run_dir = Path(run_dir)
        self.start = time.time()
        self.writer = None
        self.bar = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tb" / process))
        if cfg.progress_bar and total_steps:
            self.bar = tqdm(
                total=total_steps,
                desc=process,
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=1.0,
            )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"process": self.process, "step": step, "time": round(time.time() - self.start, 3)}
        record.update({k: float(v) for k, v in scalars.items()})
        self.jsonl.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, float(value), step)

    def image(self, step: int, tag: str, picture: np.ndarray) -> Path | None:
        """A picture ([H, W, 3] uint8) as ``RUN_DIR/images/PROCESS_TAG_STEP.png`` and in
        TensorBoard's image tab; returns the PNG's path."""
        if not self.enabled:
            return None
        from PIL import Image

        folder = self.run_dir / "images"
        folder.mkdir(exist_ok=True)
        path = folder / f"{self.process}_{tag.replace('/', '_')}_{step:06d}.png"
        Image.fromarray(picture).save(path)
        if self.writer is not None:
            self.writer.add_image(tag, picture, step, dataformats="HWC")
        return path

    def progress(self, steps: int, postfix: dict[str, Any] | None = None) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def write_summary(self, summary: dict[str, Any], name: str = "summary.json") -> None:
        """``RUN_DIR/name``: the run's summary (the trainer's), or a process's own."""
        if not self.enabled:
            return
        summary = {"wall_time_s": round(time.time() - self.start, 2), **summary}
        tmp = self.run_dir / f"{name}.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(self.run_dir / name)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        self.jsonl.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of ``RUN_DIR/metrics.jsonl``; a last line still being written is skipped."""
    lines = [line for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    records = [json.loads(line) for line in lines[:-1]]
    with contextlib.suppress(json.JSONDecodeError):
        records += [json.loads(line) for line in lines[-1:]]
    return records
