"""The image chain's preference stages: pairs of the policy's own pictures ranked by the
judge, the picture scorer (reward model) and Diffusion-DPO's loss; and both stages
through the launcher on a small policy and a pair file written here."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.algorithms.flow_dpo import diffusion_dpo_loss, velocity_errors
from asyncrl.algorithms.preference import DPOLossConfig, dpo_loss
from asyncrl.config import ConfigError, apply_overrides, load_experiment
from asyncrl.image import pairs as image_pairs
from asyncrl.image.check import judge
from asyncrl.image.model import ImageModelConfig, ImagePolicy, to_pixels
from asyncrl.image.pairs import PicturePairs, make_pairs, mirrored, rejudged
from asyncrl.image.render import draw
from asyncrl.image.sample import generate_batched
from asyncrl.image.scenes import BACKGROUND, all_scenes, sample_scenes
from asyncrl.image.scorer import (
    ConvReader,
    PictureScorer,
    PolicyReader,
    ScorerConfig,
    WordReader,
)
from asyncrl.stages.image_rm import ranking_accuracy

ROOT = Path(__file__).resolve().parents[1]
SMALL = ImageModelConfig(layers=1, heads=2, head_dim=8, text_dim=16)


def drawn_pairs(n: int, held_out: bool, seed: int) -> PicturePairs:
    """Pairs the judge tells apart for sure: a drawing of the scene against an empty
    picture."""
    scenes = sample_scenes(n, held_out=held_out, seed=seed)
    rng = random.Random(seed)
    chosen = np.stack([draw(s, rng) for s in scenes])
    rejected = np.broadcast_to(np.array(BACKGROUND, dtype=np.uint8), chosen.shape).copy()
    scores = [judge(c, s).reward for c, s in zip(chosen, scenes)]
    empty = [judge(r, s).reward for r, s in zip(rejected, scenes)]
    return PicturePairs(
        [s.prompt for s in scenes], chosen, rejected, np.array(scores), np.array(empty)
    )


def test_pairs_are_the_policy_s_own_pictures_best_against_worst(tmp_path, monkeypatch, caplog):
    torch.manual_seed(0)
    policy = ImagePolicy(SMALL)
    scenes = sample_scenes(8, held_out=False, seed=0)
    monkeypatch.setattr(image_pairs, "PROGRESS_EVERY_S", 0.0)  # say how far at every batch
    with caplog.at_level(logging.INFO, logger="asyncrl.image.pairs"):
        pairs = make_pairs(policy, scenes, per_prompt=3, steps=3, shift=3.0, seed=5, batch=16)
    said = [r.getMessage().split(" (")[0] for r in caplog.records]
    assert said == ["16 of 24 pictures drawn for pairs", "24 of 24 pictures drawn for pairs"]
    assert len(pairs) <= 8 and pairs.chosen.shape[1:] == (32, 32, 3)
    assert (pairs.chosen_score > pairs.rejected_score).all()
    by_prompt = {s.prompt: s for s in scenes}
    for prompt, picture, score in zip(pairs.prompts, pairs.chosen, pairs.chosen_score):
        assert judge(picture, by_prompt[prompt]).reward == pytest.approx(score)
    pairs.save(tmp_path / "p.npz")
    again = PicturePairs.load(tmp_path / "p.npz")
    assert again.prompts == pairs.prompts and np.array_equal(again.rejected, pairs.rejected)


def test_a_mirrored_pair_is_judged_as_the_pair_and_never_becomes_a_held_out_scene():
    pairs = drawn_pairs(64, False, 2)
    chosen, rejected, prompts = mirrored(
        pairs.chosen, pairs.rejected, pairs.prompts, np.random.default_rng(0)
    )
    by_prompt = {s.prompt: s for s in all_scenes()}
    flipped = [i for i, (a, b) in enumerate(zip(chosen, pairs.chosen)) if not np.array_equal(a, b)]
    assert len(flipped) > 16 and any(p != q for p, q in zip(prompts, pairs.prompts))
    for i, prompt in enumerate(prompts):
        scene = by_prompt[prompt]
        assert not scene.held_out
        before = judge(pairs.chosen[i], by_prompt[pairs.prompts[i]])
        assert list(judge(chosen[i], scene).checks.values()) == list(before.checks.values())
        assert judge(rejected[i], scene).reward == pairs.rejected_score[i]
    moved = [i for i in range(len(prompts)) if prompts[i] != pairs.prompts[i]]
    assert moved and all(by_prompt[prompts[i]].relation for i in moved)


def test_rejudged_pairs_are_the_same_pictures_ranked_by_the_judge_under_near_prompts():
    pairs = drawn_pairs(48, False, 3)
    extra = rejudged(pairs, 200, seed=0)
    assert len(extra) == 200
    by_prompt = {s.prompt: s for s in all_scenes()}
    known = {p.tobytes() for p in np.concatenate([pairs.chosen, pairs.rejected])}
    drawn_for = {p.tobytes(): q for p, q in zip(pairs.chosen, pairs.prompts)}
    moved = 0
    for prompt, chosen, rejected, cs, rs in zip(
        extra.prompts, extra.chosen, extra.rejected, extra.chosen_score, extra.rejected_score
    ):
        scene = by_prompt[prompt]
        assert not scene.held_out
        assert chosen.tobytes() in known and rejected.tobytes() in known
        assert cs > rs and judge(chosen, scene).reward == pytest.approx(cs)
        assert judge(rejected, scene).reward == pytest.approx(rs)
        origin = drawn_for.get(chosen.tobytes())
        if origin is not None and origin != prompt:
            assert sum(a != b for a, b in zip(origin.split(), prompt.split())) == 1
            moved += 1
    # Drawings are of their own scene, so under a scene a word away they lose a check.
    assert moved > 20
    joined = pairs.joined(extra)
    assert len(joined) == len(pairs) + 200 and joined.prompts[-1] == extra.prompts[-1]


def test_diffusion_dpo_is_dpo_on_velocity_errors_and_moves_the_chosen_one():
    torch.manual_seed(1)
    policy = ImagePolicy(SMALL)
    reference = ImagePolicy(SMALL)
    reference.load_state_dict(policy.state_dict())
    pairs = drawn_pairs(4, held_out=False, seed=1)
    chosen, rejected = to_pixels(pairs.chosen), to_pixels(pairs.rejected)
    cfg = DPOLossConfig(beta=50.0)
    loss, _ = diffusion_dpo_loss(
        policy, reference, chosen, rejected, pairs.prompts, cfg, torch.Generator().manual_seed(2)
    )
    assert loss.item() == pytest.approx(4 * np.log(2), rel=1e-5)  # policy = reference: h = 0
    # The same draws by hand: t and noise shared by each pair's two pictures.
    g = torch.Generator().manual_seed(2)
    t = torch.sigmoid(torch.randn(4, generator=g)).repeat(2)
    eps = torch.randn(chosen.shape, generator=g).repeat(2, 1, 1, 1)
    x0, both = torch.cat([chosen, rejected]), pairs.prompts * 2
    e = velocity_errors(policy, x0, both, t, eps)
    manual, _ = dpo_loss(-e[:4], -e[4:], -e[:4].detach(), -e[4:].detach(), cfg)
    torch.testing.assert_close(loss, manual)
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        after = velocity_errors(policy, x0, both, t, eps)
        ref = velocity_errors(reference, x0, both, t, eps)
    margin = -(after[:4] - ref[:4]) + (after[4:] - ref[4:])
    assert margin.mean() > 0  # the chosen pictures' error fell against the rejected ones'


@pytest.mark.parametrize("reader", ["conv", "words", "policy"])
def test_the_scorer_learns_to_rank_as_the_judge_and_reloads(reader, tmp_path):
    torch.manual_seed(0)
    if reader == "policy":  # the reader is a policy's transformer, fine-tuned
        ImagePolicy(SMALL).save(tmp_path / "policy")
        cfg = ScorerConfig(backbone=str(tmp_path / "policy"), per_patch=2, hidden=32)
    else:
        cfg = ScorerConfig(reader=reader, channels=8, text_dim=8, hidden=32)
    scorer = PictureScorer(cfg)
    kinds = {"conv": ConvReader, "words": WordReader, "policy": PolicyReader}
    assert isinstance(scorer.reader, kinds[reader])
    train, held_out = drawn_pairs(64, False, 0), drawn_pairs(32, True, 1)
    opt = torch.optim.AdamW(scorer.parameters(), lr=3e-3)
    for _ in range(30):
        chosen = scorer.score(to_pixels(train.chosen), train.prompts)
        rejected = scorer.score(to_pixels(train.rejected), train.prompts)
        loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert ranking_accuracy(scorer, held_out) == 1.0
    scorer.save(tmp_path / "rm")
    again = PictureScorer.load(tmp_path / "rm")
    x = to_pixels(held_out.chosen[:4])
    torch.testing.assert_close(
        again.score(x, held_out.prompts[:4]), scorer.score(x, held_out.prompts[:4])
    )


@pytest.mark.parametrize("stage", ["image_rm", "image_dpo"])
def test_the_preference_stages_run_from_their_experiments(stage, tmp_path):
    policy = tmp_path / "policy"
    ImagePolicy(SMALL).save(policy)
    pairs_dir = tmp_path / "pairs"
    drawn_pairs(32, False, 0).save(pairs_dir / "train.npz")
    drawn_pairs(16, True, 1).save(pairs_dir / "held_out.npz")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "launch/local.py", f"experiments/{stage}.py", f"run_dir={run_dir}"]
    cmd += [f"pairs.dir={pairs_dir}", f"pairs.policy={policy}", "batch_size=8"]
    cmd += ["max_steps=4", "trainer.threads_per_rank=1"]
    if stage == "image_rm":
        cmd += ["eval_every=2", f"export_dir={tmp_path / 'rm'}", "pairs.rejudged=40"]
        cmd += ["scorer.channels=8", "scorer.text_dim=8", "scorer.hidden=16"]
    else:
        cmd += ["eval.every_steps=2", "eval.num_scenes=8", "eval.steps=3"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    if stage == "image_rm":
        assert summary["train_pairs"] == 32 + 40 and 0 <= summary["final_ranking_accuracy"] <= 1
        assert (tmp_path / "rm" / "scorer.json").exists()
    else:
        assert "eval/success_position" in summary["final_eval"]
        assert (Path(summary["export_dir"]) / "image_model.json").exists()


def test_an_unknown_reader_is_refused_before_any_process(tmp_path):
    cfg = load_experiment(ROOT / "experiments" / "image_rm.py")
    cfg = apply_overrides(cfg, [f"run_dir={tmp_path}", "scorer.reader=vit"])
    with pytest.raises(ConfigError, match="scorer.reader='vit': expected one of .'conv', 'words'."):
        cfg.finalize()


def test_a_stage_whose_loss_turns_non_finite_stops_naming_the_step(tmp_path):
    """At a learning rate of 1e30 the first update makes every score inf, so the loss is
    NaN from step 2: the stage skips two such steps, stops at the second naming it, and
    exports nothing."""
    policy = tmp_path / "policy"
    ImagePolicy(SMALL).save(policy)
    pairs_dir = tmp_path / "pairs"
    drawn_pairs(16, False, 0).save(pairs_dir / "train.npz")
    drawn_pairs(8, True, 1).save(pairs_dir / "held_out.npz")
    cmd = [sys.executable, "launch/local.py", "experiments/image_rm.py"]
    cmd += [f"run_dir={tmp_path / 'run'}", f"pairs.dir={pairs_dir}", f"pairs.policy={policy}"]
    cmd += ["pairs.rejudged=0", "batch_size=8", "max_steps=10", "eval_every=100"]
    cmd += ["scorer.channels=8", "scorer.text_dim=8", "scorer.hidden=16", "optim.lr=1e30"]
    cmd += ["optim.warmup_steps=0", "trainer.max_nonfinite_steps=2", "trainer.threads_per_rank=1"]
    cmd += [f"export_dir={tmp_path / 'rm'}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "2 consecutive steps had a non-finite loss or gradient (the last at step 3)" in (
        out.stdout + out.stderr
    )
    assert not (tmp_path / "rm").exists()


def test_pictures_drawn_in_batches_are_those_drawn_alone():
    """``generate_batched``'s batches are for memory only: each picture comes from its own
    seed's noise, so batches of 3 give the pictures of one batch of all, bit for bit."""
    torch.manual_seed(0)
    policy = ImagePolicy(SMALL).eval()
    prompts = [s.prompt for s in sample_scenes(5, held_out=False, seed=0)]
    seeds = [11, 12, 13, 14, 15]
    drawn: list[int] = []
    batched = generate_batched(policy, prompts, seeds, 3, 3.0, batch=3, progress=drawn.append)
    whole = generate_batched(policy, prompts, seeds, 3, 3.0, batch=5)
    assert drawn == [3, 5] and batched.shape == (5, *whole.shape[1:])
    assert torch.equal(batched, whole)
