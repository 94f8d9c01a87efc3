"""PPO's critic: the clipped value loss by hand, value alignment with the logprobs, packed
values and advantages equal to each sequence computed alone, the critic's training,
checkpoint and export, and a short PPO run through the real launcher."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.algorithms.advantages import gae
from asyncrl.algorithms.losses import token_entropy, token_values, value_loss
from asyncrl.balance import split_balanced
from asyncrl.loop.critic import Critic, CriticConfig, reward_on_last_token
from asyncrl.metrics import read_metrics
from asyncrl.models import ModelConfig, load_model
from asyncrl.trainer.checkpoint import export_hf, load_checkpoint, save_checkpoint
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore
from asyncrl.trainer.dist import init_distributed, shutdown_distributed
from asyncrl.trainer.packing import MicroBatch, TokenSequence, make_micro_batches

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def critic_dir(tiny_model_dir, tmp_path_factory):
    """A value model with a random head, so values differ from token to token."""
    model = load_model(ModelConfig(path=tiny_model_dir, head="value"))
    torch.manual_seed(1)
    with torch.no_grad():
        model.score.weight.normal_(std=1.0)
        model.score.bias.fill_(0.3)
    out = tmp_path_factory.mktemp("models") / "critic"
    model.save_pretrained(out)
    return str(out)


def sequences(n: int, vocab: int, seed: int = 0) -> list[TokenSequence]:
    """Random prompt + completion sequences carrying a reward on their last token."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(5, 30)
        prompt = rng.randint(2, length - 2)
        mask = [0] * prompt + [1] * (length - prompt)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        out.append(TokenSequence(ids, mask, {"rewards": reward_on_last_token(mask, rng.random())}))
    return out


def t(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64)


def test_value_loss_hand_computed():
    """ε = 0.2. Token 0 is the prompt (masked); then
    1: V − V_old = 0.1 inside the clip               ½(0.5 − 1)²   = 0.125
    2: V far from V_old, unclipped error larger      ½(1 − 0)²     = 0.5
    3: clipped value V_c = 0.4 further from R = 2     ½(0.4 − 2)²   = 1.28 (clipped)
    4: V = −1 below V_old, unclipped error larger    ½(−1 − 0)²    = 0.5
    """
    values = t(5.0, 0.5, 1.0, 1.0, -1.0).requires_grad_()
    old, returns = t(0.0, 0.4, 0.2, 0.2, 0.0), t(0.0, 1.0, 0.0, 2.0, 0.0)
    mask = t(0, 1, 1, 1, 1)
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.125 + 0.5 + 1.28 + 0.5)
    assert metrics["critic/clip_fraction"].item() == 1
    loss.backward()
    # The clipped token gets no gradient; the others get V − R.
    assert values.grad.tolist()[0] == pytest.approx([0.0, -0.5, 1.0, 0.0, -1.0])
    unclipped, _ = value_loss(values, old, returns, mask, clip=0.0)
    assert unclipped.item() == pytest.approx(0.5 * (0.25 + 1 + 1 + 1))


def test_gae_of_packed_rows_equals_each_sequence_alone():
    """Two sequences in one row (position ids restart at the second): GAE must not carry
    the second's values and advantages back into the first."""
    first, second = (
        (t(0, 0, 1), t(0.1, 0.2, 0.3), t(0, 1, 1)),
        (t(0, 0, 0, 2), t(1, 2, 3, 4), t(0, 1, 1, 1)),
    )
    alone = [gae(r, v, m, gamma=0.9, lam=0.8) for r, v, m in (first, second)]
    packed_inputs = [torch.cat([a, b], dim=1) for a, b in zip(first, second)]
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    adv, ret = gae(*packed_inputs, gamma=0.9, lam=0.8, position_ids=position_ids)
    torch.testing.assert_close(adv, torch.cat([alone[0][0], alone[1][0]], dim=1))
    torch.testing.assert_close(ret, torch.cat([alone[0][1], alone[1][1]], dim=1))
    leaky, _ = gae(*packed_inputs, gamma=0.9, lam=0.8)  # without the boundaries it leaks
    assert not torch.allclose(leaky, adv)


def test_value_model_starts_from_the_policy_backbone(tiny_model_dir):
    policy = load_model(ModelConfig(path=tiny_model_dir))
    critic = load_model(ModelConfig(path=tiny_model_dir, head="value"))
    assert torch.all(critic.score.weight == 0) and torch.all(critic.score.bias == 0)
    assert critic.dropout.p == 0.0
    backbone = policy.model.state_dict()
    for name, tensor in critic.model.state_dict().items():
        assert torch.equal(tensor, backbone[name]), name
    out = critic(torch.tensor([[3, 4, 5]]), use_cache=False).logits
    assert out.shape == (1, 3, 1) and torch.all(out == 0)


def test_value_t_sees_exactly_what_the_logprob_of_token_t_sees(tiny_model_dir, critic_dir):
    """V_t and the distribution of token t (entropy here, logprobs likewise) both come from
    position t − 1: changing token k leaves them unchanged for t ≤ k and moves V_{k+1}."""
    policy, critic = (
        load_model(ModelConfig(path=tiny_model_dir)),
        load_model(ModelConfig(path=critic_dir, head="value")),
    )
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    head = critic(ids, use_cache=False).logits
    values = token_values(head)
    assert values[0, 0] == 0 and torch.equal(values[0, 1:], head[0, :-1, 0])
    k = 3
    changed = ids.clone()
    changed[0, k] = 11
    new_values = token_values(critic(changed, use_cache=False).logits)
    entropy = token_entropy(policy(ids, use_cache=False).logits)
    new_entropy = token_entropy(policy(changed, use_cache=False).logits)
    torch.testing.assert_close(new_values[:, : k + 1], values[:, : k + 1])
    torch.testing.assert_close(new_entropy[:, : k + 1], entropy[:, : k + 1])
    assert not torch.allclose(new_values[:, k + 1], values[:, k + 1])
    assert not torch.allclose(new_entropy[:, k + 1], entropy[:, k + 1])


def _segments(micro: list[MicroBatch], name: str) -> dict[tuple[int, ...], torch.Tensor]:
    """Field ``name`` of every sequence in the micro-batches, keyed by its token ids."""
    out = {}
    for mb in micro:
        for row in range(mb.input_ids.shape[0]):
            starts = (mb.position_ids[row] == 0).nonzero().flatten().tolist() + [
                mb.input_ids.shape[1]
            ]
            for a, b in zip(starts, starts[1:]):
                out[tuple(mb.input_ids[row, a:b].tolist())] = mb.fields[name][row, a:b]
    return out


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_critic_values_and_advantages_equal_each_sequence_alone(dist_info, critic_dir, layout):
    cfg = CriticConfig(path=critic_dir, gamma=0.95, lam=0.9, whiten_advantages=False)
    critic = Critic(cfg, ModelConfig(), TrainerConfig(), dist_info, pad_id=0, max_steps=1)
    seqs = sequences(10, critic.core.model.config.vocab_size)
    micro = make_micro_batches(seqs, budget=120, layout=layout, row_tokens=60)
    if layout == "packed":
        assert any(((mb.position_ids == 0).sum(1) > 1).any() for mb in micro)
    critic.values(micro)
    critic.advantages(micro)
    values, advantages = _segments(micro, "values"), _segments(micro, "advantages")
    plain = load_model(ModelConfig(path=critic_dir, head="value"))
    for s in seqs:
        ids = torch.tensor([s.input_ids])
        alone = token_values(plain(ids, use_cache=False).logits)
        # From t = 1: at a packed sequence's first token the head sits on the previous
        # sequence, exactly as its logprob does; token 0 is never a target.
        got = values[tuple(s.input_ids)]
        torch.testing.assert_close(got[1:], alone[0, 1:], atol=1e-5, rtol=1e-5)
        mask, rewards = (
            torch.tensor([s.loss_mask], dtype=torch.float32),
            torch.tensor([s.fields["rewards"]]),
        )
        adv, _ = gae(rewards, alone, mask, gamma=0.95, lam=0.9)
        torch.testing.assert_close(advantages[tuple(s.input_ids)], adv[0], atol=1e-5, rtol=1e-5)


def _two_rank_advantages(out: str, rendezvous: str, critic_dir: str) -> None:
    """One rank of the test below: whitened advantages of this rank's share of a batch."""
    torch.set_num_threads(1)
    info = init_distributed("cpu", rendezvous)
    critic = Critic(CriticConfig(path=critic_dir), ModelConfig(), TrainerConfig(), info, 0, 1)
    seqs = sequences(12, critic.core.model.config.vocab_size, seed=2)
    mine = split_balanced([len(s) for s in seqs], info.world_size)[info.rank]
    micro = make_micro_batches([seqs[i] for i in mine], budget=200, row_tokens=100)
    critic.values(micro)
    metrics = critic.advantages(micro)
    torch.save({"advantages": _segments(micro, "advantages"), "metrics": metrics}, out)
    shutdown_distributed()


def test_whitening_uses_statistics_of_the_global_batch(dist_info, critic_dir, tmp_path):
    """Two ranks, each with half of the batch, whiten exactly as one rank with all of it."""
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1")
        env.pop("MASTER_ADDR", None)
        args = [str(tmp_path / f"rank{rank}.pt"), str(tmp_path / "rdv"), critic_dir]
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, *args],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for proc in procs:
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    one = Critic(CriticConfig(path=critic_dir), ModelConfig(), TrainerConfig(), dist_info, 0, 1)
    seqs = sequences(12, one.core.model.config.vocab_size, seed=2)
    micro = make_micro_batches(seqs, budget=200, row_tokens=100)
    one.values(micro)
    metrics = one.advantages(micro)
    expected = _segments(micro, "advantages")
    split = {**ranks[0]["advantages"], **ranks[1]["advantages"]}
    assert len(ranks[0]["advantages"]) < len(expected)  # each rank really had only a part
    for s in seqs:
        key = tuple(s.input_ids)
        torch.testing.assert_close(split[key][1:], expected[key][1:], atol=1e-5, rtol=1e-4)
    for r in ranks:
        assert r["metrics"] == pytest.approx(metrics, rel=1e-4, abs=1e-6)


def test_critic_learns_whitens_checkpoints_and_exports(dist_info, tiny_model_dir, tmp_path):
    """Two clipped steps per batch; the value loss falls, the clip binds on the second step,
    advantages are whitened, and a checkpoint restores weights and steps."""
    cfg = CriticConfig(
        value_clip=0.01, steps_per_batch=2, optim=OptimConfig(lr=3e-3, warmup_steps=0)
    )
    make = lambda: Critic(cfg, ModelConfig(path=tiny_model_dir), TrainerConfig(), dist_info, 0, 3)  # noqa: E731
    critic = make()
    seqs = sequences(8, critic.core.model.config.vocab_size, seed=1)
    losses = []
    for _ in range(3):
        micro = make_micro_batches(seqs, budget=256, row_tokens=128)
        critic.values(micro)
        estimates = critic.advantages(micro)
        metrics = critic.train(micro)
        losses.append(metrics["critic/value_loss"])
    assert critic.core.step == 6
    assert losses[2] < losses[1] < losses[0]
    assert metrics["critic/clip_fraction"] > 0
    assert {
        "critic/grad_norm",
        "critic/lr",
    } <= metrics.keys() and "critic/explained_variance" in estimates
    adv = torch.cat([mb.fields["advantages"][mb.loss_mask > 0] for mb in micro])
    assert adv.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert adv.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)

    frozen = OptimConfig(lr=0.0, warmup_steps=0)
    policy = TrainerCore(ModelConfig(path=tiny_model_dir), TrainerConfig(), frozen, dist_info, 0)
    policy.step = 3
    path = save_checkpoint(
        policy, tmp_path / "ckpt", {}, keep=1, companions={"critic": critic.core}
    )
    fresh = make()
    fresh_policy = TrainerCore(
        ModelConfig(path=tiny_model_dir), TrainerConfig(), frozen, dist_info, 0
    )
    load_checkpoint(fresh_policy, path, {"critic": fresh.core})
    assert (fresh_policy.step, fresh.core.step) == (3, 6)
    assert fresh.core.scheduler.last_epoch == critic.core.scheduler.last_epoch
    trained = critic.core.full_state_dict()
    for name, tensor in fresh.core.full_state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    exported = load_model(
        ModelConfig(path=str(export_hf(critic.core, tmp_path / "hf")), head="value")
    )
    assert torch.equal(exported.score.weight, trained["score.weight"])
    assert exported.score.weight.abs().sum() > 0  # a saved head is loaded, not zeroed
    save_checkpoint(policy, tmp_path / "bare", {}, keep=1)
    with pytest.raises(FileNotFoundError, match="critic"):
        load_checkpoint(fresh_policy, tmp_path / "bare" / "step_00000003", {"critic": fresh.core})


def test_launcher_runs_tiny_ppo(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "launch/local.py",
        "experiments/tiny_ppo.py",
        f"run_dir={run_dir}",
        f"model.path={tiny_model_dir}",
        "rl.max_steps=3",
        "eval.every_steps=0",
        "eval.num_examples=0",
        "task.train_size=200",
        "buffer.prompts_per_batch=4",
        "buffer.samples_per_prompt=2",
        "engine.embedded.max_slots=8",
        "transport.heartbeat_s=0.2",
        "optim.warmup_steps=0",
        "rl.critic.optim.warmup_steps=0",
        "rl.critic.warmup_steps=1",
        "rl.loss.kl_coef=0.1",
        "rl.loss.kl_in_reward=true",
        # The random model never answers right; the overlong penalty gives the critic a target.
        "rl.overlong_cache=4",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    records = [r for r in read_metrics(run_dir) if r["process"] == "trainer" and "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    names = [
        "critic/value_loss",
        "critic/explained_variance",
        "critic/value_mean",
        "critic/grad_norm",
    ]
    assert all(math.isfinite(r[n]) for r in records for n in names)
    assert all(r["critic/return_mean"] < 0 for r in records)
    assert records[0]["critic/value_mean"] == 0.0  # the zero head, before its first step
    assert records[-1]["critic/value_mean"] != 0.0  # the critic has trained
    # Step 1 is the critic's warmup: the policy takes no step; then it does.
    assert records[0]["train/grad_norm"] == 0.0 and records[0]["train/loss"] == 0.0
    assert all(r["train/grad_norm"] > 0 for r in records[1:])
    # The KL penalty is in the rewards: the policy stepped away from the reference.
    assert records[-1]["train/kl_reference"] > 0
    step_dir = run_dir / "checkpoints" / "step_00000003"
    assert (step_dir / "critic" / ".metadata").is_file()
    assert json.loads((step_dir / "meta.json").read_text())["companion_steps"] == {"critic": 3}


if __name__ == "__main__":  # a rank of test_whitening_uses_statistics_of_the_global_batch
    _two_rank_advantages(*sys.argv[1:4])
