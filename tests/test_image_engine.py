"""The image engine (continuous batching over denoising steps, flips between steps) and
Flow-GRPO's loss: the trainer's recomputed per-step log-probability is the generator's
under the same weights, a picture interrupted by a flip carries two versions and its
loss weighs each step by its own, and a picture continued from its frames ends where it
would have."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncrl.algorithms.flow_grpo import (
    PER_DIMENSION,
    flow_grpo_loss,
    step_distributions,
    step_kl,
    train_steps,
)
from asyncrl.algorithms.losses import PPOLossConfig
from asyncrl.buffer.image_rollout import ImageRolloutConfig
from asyncrl.engine.image import ImageEngine, ImageRequest, ImageSamplingConfig, start_noise
from asyncrl.generator.images import ImageGeneratorWorker
from asyncrl.image.frames import from_bytes, prompt_ids, prompt_text, to_bytes
from asyncrl.image.model import ImageModelConfig, ImagePolicy
from asyncrl.image.scenes import all_scenes
from asyncrl.wire import Lease, SamplingSpec

SMALL = ImageModelConfig(layers=1, heads=2, head_dim=8, text_dim=16)
SAMPLING = ImageSamplingConfig(steps=6, shift=3.0, noise_level=0.7)


@pytest.fixture
def policies():
    """Weights version 0 and version 1 (the same, moved by noise)."""
    torch.manual_seed(0)
    first = ImagePolicy(SMALL)
    second = {k: v + 0.05 * torch.randn_like(v) for k, v in first.state_dict().items()}
    return first, second


def run(engine: ImageEngine, until=None) -> dict[str, list]:
    """Step until every picture is done (or ``until(step number)`` says stop): {request
    id: [(GeneratedToken, frames)]}, one per step taken; finished ids in ``run.done``."""
    records: dict[str, list] = {}
    count = 0
    while engine.status().running and not (until and until(count)):
        out = engine.step()
        for token in out.tokens:
            records.setdefault(token.request_id, []).append((token, out.frames[token.request_id]))
        run.done += [f.request_id for f in out.finished]
        count += 1
    return records


run.done = []


def frames_of(records) -> torch.Tensor:
    return torch.cat([frames for _, frames in records])


def column(records, name: str) -> list:
    return [getattr(token, name) for token, _ in records]


def test_pictures_at_different_steps_share_a_batch_and_do_not_depend_on_it(policies):
    policy, _ = policies
    engine = ImageEngine(policy, SAMPLING)
    engine.submit(ImageRequest("a", "a red square", seed=1))
    first = run(engine, until=lambda n: n == 3)
    engine.submit(ImageRequest("b", "two blue circles", seed=2))
    out = engine.step()
    assert sorted((t.request_id, t.token_id) for t in out.tokens) == [("a", 3), ("b", 0)]
    rest = run(engine)
    a = first["a"] + [(t, out.frames["a"]) for t in out.tokens if t.request_id == "a"] + rest["a"]
    assert column(a, "token_id") == list(range(SAMPLING.steps)) and "a" in run.done
    assert a[0][1].shape[0] == 2 and torch.equal(a[0][1][0], start_noise(1))
    assert all(frames.shape[0] == 1 for _, frames in a[1:])
    alone = ImageEngine(ImagePolicy(SMALL), SAMPLING)
    alone.policy.load_state_dict(policy.state_dict())
    alone.submit(ImageRequest("a", "a red square", seed=1))
    torch.testing.assert_close(frames_of(run(alone)["a"]), frames_of(a), rtol=1e-4, atol=1e-4)


def test_the_trainer_recomputes_the_generator_s_step_logprobs(policies):
    policy, _ = policies
    engine = ImageEngine(policy, SAMPLING)
    prompts = ["a red square", "three green circles", "a blue circle left of a red square"]
    for i, prompt in enumerate(prompts):
        engine.submit(ImageRequest(str(i), prompt, seed=10 + i))
    records = run(engine)
    frames = torch.stack([frames_of(records[str(i)]) for i in range(3)])
    steps = torch.arange(SAMPLING.steps).repeat(3, 1)
    with torch.no_grad():
        again = step_distributions(
            policy, frames, prompts, steps, engine.grid, SAMPLING.noise_level
        )[0]
    behavior = torch.tensor([column(records[str(i)], "logprob") for i in range(3)])
    torch.testing.assert_close(again, behavior, rtol=1e-5, atol=0.05)
    # Not any number would do: a first step to another picture's frame is far less likely.
    crossed = torch.cat([frames[:, :1], frames.flip(0)[:, 1:]], dim=1)
    with torch.no_grad():
        other = step_distributions(policy, crossed, prompts, steps, engine.grid, 0.7)[0]
    assert (other[[0, 2], 0] < behavior[[0, 2], 0] - 1000).all()


def test_a_flip_between_steps_gives_a_picture_two_versions_and_its_loss_weighs_each(policies):
    policy, newer = policies
    engine = ImageEngine(policy, SAMPLING)
    engine.submit(ImageRequest("a", "two red squares", seed=3))
    records = run(engine, until=lambda n: n == 2)["a"]
    engine.stage_weights(newer, version=1)
    records += run(engine)["a"]
    versions = column(records, "version")
    assert versions == [0, 0, 1, 1, 1, 1]
    frames = frames_of(records).unsqueeze(0)
    steps = torch.arange(SAMPLING.steps).unsqueeze(0)
    behavior = torch.tensor([column(records, "logprob")])
    with torch.no_grad():  # the trainer holds version 1: its proximal policy
        proximal = step_distributions(policy, frames, ["two red squares"], steps, engine.grid, 0.7)[
            0
        ]
    drift = (proximal - behavior) * PER_DIMENSION
    assert drift[0, 2:].abs().max() < 1e-6  # taken under the trainer's weights
    assert drift[0, :2].abs().min() > 1e-5  # taken under the older ones
    logprobs = proximal.clone().requires_grad_(True)
    cfg = PPOLossConfig(clip_low=1e-3, clip_high=1e-3)
    loss, metrics = flow_grpo_loss(logprobs, proximal, behavior, torch.tensor([1.0]), cfg)
    loss.backward()
    weights = -logprobs.grad[0] / PER_DIMENSION  # ratio 1 at the proximal: grad = -w·A/D
    torch.testing.assert_close(weights, torch.exp(drift[0]).clamp(max=cfg.iw_cap))
    assert metrics["train/importance_weight"] == pytest.approx(float(weights.sum()), rel=1e-5)


def test_a_picture_continued_from_its_frames_ends_where_it_would_have(policies):
    policy, _ = policies
    whole = ImageEngine(policy, SAMPLING)
    whole.submit(ImageRequest("a", "a yellow circle above a green square", seed=5))
    uninterrupted = frames_of(run(whole)["a"])
    first = ImageEngine(policy, SAMPLING)
    first.submit(ImageRequest("a", "a yellow circle above a green square", seed=5))
    sent = to_bytes(frames_of(run(first, until=lambda n: n == 4)["a"]))  # a crash here
    second = ImageEngine(policy, SAMPLING)
    second.submit(ImageRequest("a", "a yellow circle above a green square", 5, from_bytes(sent)))
    rest = run(second)["a"]
    assert column(rest, "token_id") == [4, 5] and rest[0][1].shape[0] == 1
    continued = torch.cat([from_bytes(sent), frames_of(rest)])
    torch.testing.assert_close(continued, uninterrupted, rtol=1e-5, atol=1e-5)


def test_bad_requests_and_frames_are_named():
    engine = ImageEngine(ImagePolicy(SMALL), SAMPLING)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.submit(ImageRequest("x", "a purple square", seed=0))
    with pytest.raises(ValueError, match="'y'.*frames"):
        engine.submit(ImageRequest("y", "a red square", 0, torch.zeros(7, 3, 32, 32)))
    with pytest.raises(ValueError, match="do not fit"):
        engine.stage_weights({"transformer.nothing": torch.zeros(1)}, version=1)
    with pytest.raises(ValueError, match="whole number"):
        from_bytes(b"\0" * 100, "chunk 3")
    assert prompt_text(prompt_ids("two red squares left of a blue circle")) == (
        "two red squares left of a blue circle"
    )
    with pytest.raises(ValueError, match="not words"):
        prompt_text([0, 999])


def test_training_steps_are_a_subset_of_each_picture_s_steps():
    steps = train_steps(10, 4, torch.Generator().manual_seed(0), n=8)
    assert steps.shape == (8, 4)
    for row in steps.tolist():
        assert row == sorted(set(row)) and all(0 <= k < 10 for k in row)
    assert len({tuple(r) for r in steps.tolist()}) > 1
    with pytest.raises(ValueError, match="1 to 10"):
        train_steps(10, 11, torch.Generator(), n=1)


def test_past_the_sde_window_steps_are_the_ode_s_without_a_log_probability(policies):
    """With ``sde_steps=2`` of 6, steps 0-1 are the SDE's (as without a window: same frames,
    the trainer recomputes their log-probabilities) and steps 2-5 the ODE's from there:
    log-probability 0, frames the deterministic Euler steps of the policy's velocity."""
    policy, _ = policies
    window = ImageSamplingConfig(steps=6, shift=3.0, noise_level=0.7, sde_steps=2)
    assert window.stochastic_steps == 2 and SAMPLING.stochastic_steps == 6
    full, part = ImageEngine(policy, SAMPLING), ImageEngine(policy, window)
    for engine in (full, part):
        engine.submit(ImageRequest("a", "two red squares", seed=3))
    sde, mixed = frames_of(run(full)["a"]), run(part)["a"]
    frames, logprobs = frames_of(mixed), column(mixed, "logprob")
    torch.testing.assert_close(frames[:3], sde[:3], rtol=1e-5, atol=1e-5)
    assert all(lp < -100 for lp in logprobs[:2]) and logprobs[2:] == [0.0] * 4
    grid = part.grid
    with torch.no_grad():
        for k in range(2, 6):
            v = policy.velocity(frames[k : k + 1], torch.tensor([grid[k]]), ["two red squares"])
            expected = frames[k] + (grid[k + 1] - grid[k]) * v[0]
            torch.testing.assert_close(frames[k + 1], expected, rtol=1e-5, atol=1e-5)
        again = step_distributions(
            policy, frames.unsqueeze(0), ["two red squares"], torch.tensor([[0, 1]]), grid, 0.7
        )[0]
    torch.testing.assert_close(again[0], torch.tensor(logprobs[:2]), rtol=1e-5, atol=0.05)
    assert not torch.allclose(frames[-1], sde[-1], atol=1e-2)  # the window changed the picture
    with pytest.raises(ValueError, match="sde_steps"):
        ImageSamplingConfig(steps=6, sde_steps=7).check()


def test_a_group_shares_its_start_noise_under_shared_start(policies):
    """The generator gives a lease its group's start seed under ``image.shared_start``
    (from the run's seed and the group); the engine starts the picture from it, while the
    steps' noise stays the picture's own."""
    cfg = ImageRolloutConfig(
        run_dir="", run_id="", seed=7, image=ImageSamplingConfig(steps=6, shared_start=True)
    )
    worker = SimpleNamespace(cfg=cfg, scenes={s.prompt: s for s in all_scenes()})

    def lease(group: int, index: int) -> Lease:
        ids = prompt_ids("a red square")
        spec = SamplingSpec(max_new_tokens=6, seed=1000 * group + index)
        return Lease(
            run_id="",
            lease_id=f"l{group}.{index}",
            prompt_id=0,
            group_id=group,
            sample_index=index,
            prompt_ids=ids,
            sampling=spec,
        )

    requests = [
        ImageGeneratorWorker.request_of(worker, lease(g, i)) for g in (1, 2) for i in (0, 1)
    ]
    assert requests[0].start_seed == requests[1].start_seed != requests[2].start_seed
    assert len({r.seed for r in requests}) == 4
    engine = ImageEngine(policies[0], cfg.image)
    for r in requests:
        engine.submit(r)
    out = engine.step()
    starts = [out.frames[r.request_id][0] for r in requests]
    assert torch.equal(starts[0], starts[1]) and not torch.equal(starts[0], starts[2])
    after = [out.frames[r.request_id][1] for r in requests]
    assert not torch.equal(after[0], after[1])  # each picture's own step noise
    cfg.image.shared_start = False
    assert ImageGeneratorWorker.request_of(worker, lease(1, 0)).start_seed is None


def test_the_kl_to_the_reference_is_the_two_gaussian_steps_own(policies):
    """``step_kl`` is the closed-form KL of the policy's and the reference's steps (same
    std) per dimension, 0 for the reference itself; the loss adds ``kl_coef`` times it,
    and its gradient pulls the policy's step means toward the reference's."""
    policy, newer = policies
    reference = ImagePolicy(SMALL)
    reference.load_state_dict(newer)
    engine = ImageEngine(policy, SAMPLING)
    engine.submit(ImageRequest("a", "a blue circle", seed=4))
    frames = frames_of(run(engine)["a"]).unsqueeze(0)
    steps = torch.tensor([[0, 3]])
    chosen = (frames, ["a blue circle"], steps, engine.grid, 0.7)
    logprobs, means, std = step_distributions(policy, *chosen)
    with torch.no_grad():
        ref_means = step_distributions(reference, *chosen)[1]
    kl = step_kl(means, ref_means, std)
    p = torch.distributions.Normal(means.detach()[0, 1], std[0, 1])
    q = torch.distributions.Normal(ref_means[0, 1], std[0, 1])
    direct = torch.distributions.kl_divergence(p, q).mean()
    torch.testing.assert_close(kl[0, 1].detach(), direct, rtol=1e-4, atol=1e-8)
    assert (kl > 0).all() and step_kl(ref_means, ref_means, std).abs().max() == 0
    cfg = PPOLossConfig(clip_low=1e-3, clip_high=1e-3, kl_coef=0.5)
    loss, metrics = flow_grpo_loss(
        logprobs, logprobs.detach(), logprobs.detach(), torch.tensor([0.0]), cfg, kl
    )
    torch.testing.assert_close(loss, 0.5 * kl.sum())  # advantage 0: the KL alone
    assert metrics["train/kl_reference"] == pytest.approx(float(kl.detach().sum()))
    loss.backward()
    with torch.no_grad():
        for weight in policy.parameters():
            if weight.grad is not None:
                weight -= 1e-3 * weight.grad
        after = step_kl(step_distributions(policy, *chosen)[1], ref_means, std)
    assert after.sum() < kl.sum()
