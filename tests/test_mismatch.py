"""The train–inference mismatch of a step (``asyncrl.loop.batch.mismatch_scalars``): figures worked
out by hand over the loss tokens of the proximal version only, and the per-token
``versions`` field through ``to_sequences`` and packing (flat and with shared prompts)
aligned with the behavior logprobs."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from asyncrl.loop.batch import mismatch_scalars, rl_micro_batches
from asyncrl.loop.config import RLConfig
from asyncrl.report import report
from asyncrl.trainer.config import TrainerConfig
from asyncrl.trainer.dist import all_reduce_max
from asyncrl.trainer.packing import MicroBatch
from asyncrl.wire import Sample

CPU = torch.device("cpu")


def _micro(mask, versions, behavior) -> MicroBatch:
    rows, width = len(mask), len(mask[0])
    return MicroBatch(
        input_ids=torch.zeros(rows, width, dtype=torch.long),
        position_ids=torch.arange(width).repeat(rows, 1),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        attention_mask=None,
        fields={
            "behavior": torch.tensor(behavior),
            "versions": torch.tensor(versions, dtype=torch.float32),
        },
        seq_lens=[width] * rows,
    )


def test_mismatch_of_hand_built_micro_batches():
    """Proximal version 3. Counted, with r = proximal − behavior: −0.5, 0, 0.5 (first
    micro-batch) and −0.25 (second). Left out: a token of version 2 (|r| 2.5, larger than
    every counted one), a version-3 token off the loss mask (|r| 6), prompts, padding."""
    first = _micro(
        mask=[[0, 1, 1, 1, 1]],
        versions=[[-1, 3, 3, 2, 3]],
        behavior=[[0.0, -1.0, -2.0, -0.5, -1.5]],
    )
    second = _micro(
        mask=[[0, 1, 0], [0, 0, 0]],
        versions=[[-1, 3, 3], [0, 0, 0]],  # the second row: padding (version 0, no loss)
        behavior=[[0.0, -1.0, -1.0], [0.0, 0.0, 0.0]],
    )
    proximal = [
        torch.tensor([[-9.0, -1.5, -2.0, -3.0, -1.0]]),
        torch.tensor([[0.0, -1.25, -7.0], [-4.0, -4.0, -4.0]]),
    ]
    out = mismatch_scalars([first, second], proximal, 3, CPU)
    assert out["mismatch/tokens"] == 4.0
    assert out["mismatch/abs_logprob_diff_mean"] == pytest.approx((0.5 + 0 + 0.5 + 0.25) / 4)
    assert out["mismatch/abs_logprob_diff_max"] == 0.5
    # k3 = e^r − 1 − r: 0.1065307 (r = −0.5), 0, 0.1487213 (0.5), 0.0288008 (−0.25)
    k3 = [math.exp(r) - 1 - r for r in (-0.5, 0.0, 0.5, -0.25)]
    assert out["mismatch/kl"] == pytest.approx(sum(k3) / 4) == pytest.approx(0.0710132, abs=1e-7)
    # No token of version 5, or no micro-batch on this rank: the count alone, 0.
    assert mismatch_scalars([first, second], proximal, 5, CPU) == {"mismatch/tokens": 0.0}
    assert mismatch_scalars([], [], 3, CPU) == {"mismatch/tokens": 0.0}


def test_the_max_over_ranks_keeps_a_float_exactly():
    for value in (0.0, 3.1e-7, 0.5, 2.75, 1e30):
        assert all_reduce_max(value, CPU) == value


def _samples(groups: int, size: int, seed: int = 0) -> list[Sample]:
    """Groups sharing a 4-token prompt; each completion's tokens from versions 2, 3 or 4
    (weights that changed while it decoded), behavior logprobs all distinct."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, 50) for _ in range(4)]
        for i in range(size):
            n = rng.randint(2, 9)
            first = rng.choice([2, 3, 4])
            versions = [min(first + (t > n // 2), 4) for t in range(n)]
            out.append(
                Sample(
                    prompt_id=g,
                    group_id=g,
                    sample_index=i,
                    token_ids=prompt + [rng.randrange(3, 50) for _ in range(n)],
                    logprobs=[0.0] * 4 + [-rng.uniform(0.01, 5.0) for _ in range(n)],
                    versions=[-1] * 4 + versions,
                    loss_mask=[0] * 4 + [1] * n,
                    reward=float(rng.random() < 0.5),
                )
            )
    return out


@pytest.mark.parametrize("share_prefix", [False, True])
def test_versions_field_is_aligned_with_behavior_through_packing(share_prefix):
    samples = _samples(groups=4, size=3)
    trainer = TrainerConfig(micro_batch_tokens=48, row_tokens=24, share_prefix=share_prefix)
    micro = rl_micro_batches(samples, RLConfig(), 64, trainer, pad_id=0)
    assert len(micro) > 1
    if share_prefix:  # the prompts really are computed once
        assert sum(mb.forward_tokens for mb in micro) < sum(mb.num_tokens for mb in micro)
    as_float = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    expected = sorted(
        (as_float(lp), v)
        for s in samples
        for lp, v, m in zip(s.logprobs, s.versions, s.loss_mask)
        if m
    )
    packed = []
    for mb in micro:
        on = mb.loss_mask.bool()
        packed += zip(mb.fields["behavior"][on].tolist(), mb.fields["versions"][on].tolist())
    assert sorted(packed) == expected
    # proximal = behavior + 0.01 × version: only version 3's tokens count, each 0.03 off.
    proximal = [mb.fields["behavior"] + 0.01 * mb.fields["versions"] for mb in micro]
    out = mismatch_scalars(micro, proximal, 3, CPU)
    assert out["mismatch/tokens"] == sum(v == 3 for _, v in expected) > 0
    assert out["mismatch/abs_logprob_diff_mean"] == pytest.approx(0.03, abs=1e-6)
    assert out["mismatch/abs_logprob_diff_max"] == pytest.approx(0.03, abs=1e-6)


def test_run_report_mismatch_figures(tmp_path):
    """The median step's mean and KL, the largest step max, the tokens; a step that
    measured none (tokens 0 alone) is out of the medians; figures of 1e-6 survive the
    report's rounding."""
    per_step = [  # mean, max, kl, tokens
        (2e-6, 1e-5, 1e-11, 100.0),
        (4e-6, 3e-5, 3e-11, 120.0),
        (None, None, None, 0.0),
        (1e-6, 2e-5, 2e-11, 80.0),
    ]
    lines = []
    for step, (mean, top, kl, tokens) in enumerate(per_step, 1):
        record = {"process": "trainer", "step": step, "time": step, "train/loss": 0.1}
        record |= {"train/tokens_per_s": 1.0, "mismatch/tokens": tokens}
        if tokens:
            record |= {
                "mismatch/abs_logprob_diff_mean": mean,
                "mismatch/abs_logprob_diff_max": top,
                "mismatch/kl": kl,
            }
        lines.append(record)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    r = report(tmp_path, [1])
    assert r["mismatch_abs_logprob_diff_median_of_means"] == 2e-6  # of 1, 2, 4 (e-6)
    assert r["mismatch_abs_logprob_diff_max"] == 3e-5
    assert r["mismatch_kl_median"] == 2e-11
    assert r["mismatch_tokens"] == 300.0
    empty = tmp_path / "none"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text(json.dumps(lines[2]) + "\n")  # the step of none
    r = report(empty, [1])
    assert r["mismatch_abs_logprob_diff_median_of_means"] is None and r["mismatch_tokens"] == 0
