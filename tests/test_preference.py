"""The preference stages: Bradley–Terry and DPO/IPO losses by hand, pairs kept whole by
the packer, DPO against itself giving log 2, the reward model's training-path score equal
to the buffer's scorer, and short reward-model and DPO runs through the real launcher."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.algorithms.preference import DPOLossConfig, bradley_terry_loss, dpo_loss
from asyncrl.buffer.reward_model import score_sequences
from asyncrl.logprobs import token_logprobs
from asyncrl.models import ModelConfig, load_model, load_tokenizer
from asyncrl.stages.dpo import reference_logprobs
from asyncrl.stages.pairs import PairData, pair_micro_batches, split_pairs
from asyncrl.stages.reward_model import completion_scores
from asyncrl.tasks.prompts import PromptRenderer
from asyncrl.trainer.config import TrainerConfig
from asyncrl.trainer.packing import TokenSequence, make_micro_batches

ROOT = Path(__file__).resolve().parents[1]


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_bradley_terry_by_hand():
    chosen, rejected = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.0, 2.0, 0.5])
    loss, metrics = bradley_terry_loss(chosen, rejected)
    assert loss.item() == pytest.approx(-(logsig(1.0) + logsig(-2.0) + logsig(0.0)), rel=1e-6)
    assert metrics["rm/accuracy"].item() == 1.0  # only the first pair is ranked right
    assert metrics["rm/margin"].item() == pytest.approx(1.0 - 2.0 + 0.0)
    with_margin, _ = bradley_terry_loss(chosen, rejected, margin=0.5)
    assert with_margin.item() == pytest.approx(
        -(logsig(0.5) + logsig(-2.5) + logsig(-0.5)), rel=1e-6
    )


def test_dpo_and_ipo_by_hand():
    pc, pr = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    rc, rr = torch.tensor([-3.5, -4.0]), torch.tensor([-3.0, -3.0])
    # h = (pc - rc) - (pr - rr): pair 0: 0.5 - (-1) = 1.5; pair 1: -1 - 1 = -2
    h = [1.5, -2.0]
    beta, eps = 0.5, 0.1
    loss, m = dpo_loss(pc, pr, rc, rr, DPOLossConfig(beta=beta, label_smoothing=eps))
    want = sum(-(1 - eps) * logsig(beta * x) - eps * logsig(-beta * x) for x in h)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["dpo/chosen_reward"].item() == pytest.approx(beta * (0.5 + -1.0))
    assert m["dpo/rejected_reward"].item() == pytest.approx(beta * (-1.0 + 1.0))
    assert m["dpo/margin"].item() == pytest.approx(beta * sum(h))
    assert m["dpo/accuracy"].item() == 1.0
    ipo, _ = dpo_loss(pc, pr, rc, rr, DPOLossConfig(beta=beta, loss_type="ipo"))
    assert ipo.item() == pytest.approx(sum((x - 1 / (2 * beta)) ** 2 for x in h), rel=1e-6)
    plain, _ = dpo_loss(pc, pr, rc, rr, DPOLossConfig(beta=beta))
    assert plain.item() == pytest.approx(sum(-logsig(beta * x) for x in h), rel=1e-6)
    # RPO: plus α × the chosen completion's per-token NLL (3 and 2 chosen tokens).
    rpo, _ = dpo_loss(
        pc, pr, rc, rr, DPOLossConfig(beta=beta, nll_coef=0.5), torch.tensor([3.0, 2.0])
    )
    assert rpo.item() == pytest.approx(plain.item() + 0.5 * (3.0 / 3 + 5.0 / 2), rel=1e-6)


def random_pairs(n: int, vocab: int, seed: int = 0) -> list[tuple[TokenSequence, TokenSequence]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(3, 12))]
        pair = []
        for _ in range(2):
            completion = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 9))]
            pair.append(
                TokenSequence(prompt + completion, [0] * len(prompt) + [1] * len(completion))
            )
        pairs.append((pair[0], pair[1]))
    return pairs


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_pairs_stay_whole_and_in_order(layout):
    pairs = random_pairs(40, 20)
    seqs = [s for p in pairs for s in p]
    micro = make_micro_batches(seqs, 96, layout, 0, row_tokens=48, group_size=2)
    assert len(micro) > 3  # the budget splits the batch, so pairs could have been torn apart
    found = []
    for mb in micro:
        assert len(mb.seq_lens) % 2 == 0
        ids = mb.input_ids.float()
        # Each sequence read back through sequence_ids / last_token is a whole input sequence.
        firsts = mb.sequence_sums(torch.where(mb.position_ids == 0, ids, 0.0))
        lasts = mb.last_token(ids)
        sums = mb.sequence_sums(ids)
        keys = [
            (mb.seq_lens[j], firsts[j].item(), lasts[j].item(), sums[j].item())
            for j in range(len(mb.seq_lens))
        ]
        found += list(zip(keys[0::2], keys[1::2]))
    key = lambda s: (len(s), float(s.input_ids[0]), float(s.input_ids[-1]), float(sum(s.input_ids)))  # noqa: E731
    assert sorted(found) == sorted((key(c), key(r)) for c, r in pairs)
    with pytest.raises(ValueError, match="groups of 2"):
        make_micro_batches(seqs[:-1], 96, layout, 0, 48, group_size=2)


def test_dpo_against_itself_is_log_2_with_zero_margins(tiny_model_dir):
    """The reference logprobs (a padded forward) and the policy's (packed, through the
    training path) agree, so DPO at the start is exactly log 2 per pair."""
    model = load_model(ModelConfig(path=tiny_model_dir)).eval()
    vocab = model.config.vocab_size
    pairs = random_pairs(12, vocab, seed=3)
    refs = reference_logprobs(model, [s for p in pairs for s in p], chunk=5)
    with_ref = [
        (
            TokenSequence(c.input_ids, c.loss_mask, {"ref_logprobs": refs[2 * i]}),
            TokenSequence(r.input_ids, r.loss_mask, {"ref_logprobs": refs[2 * i + 1]}),
        )
        for i, (c, r) in enumerate(pairs)
    ]
    cfg = TrainerConfig(micro_batch_tokens=64, row_tokens=32)
    total, margin, count = 0.0, 0.0, 0
    with torch.no_grad():
        for mb in pair_micro_batches(with_ref, cfg, pad_id=0):
            logits = model(
                input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False
            ).logits
            policy = mb.sequence_sums(token_logprobs(logits, mb.input_ids) * mb.loss_mask)
            ref = mb.sequence_sums(mb.fields["ref_logprobs"] * mb.loss_mask)
            pc, pr, _ = split_pairs(policy, mb)
            rc, rr, _ = split_pairs(ref, mb)
            assert pc.abs().min() > 1.0  # real logprob sums, not zeros
            loss, m = dpo_loss(pc, pr, rc, rr, DPOLossConfig(beta=0.1))
            total, margin, count = (
                total + loss.item(),
                margin + m["dpo/margin"].item(),
                count + len(pc),
            )
    assert count == len(pairs)
    assert total / count == pytest.approx(math.log(2), abs=1e-5)
    assert abs(margin) < 1e-5


def test_training_score_equals_the_buffer_scorer(tiny_model_dir):
    """The reward model's score as training computes it (packed, last token of each
    sequence) equals the buffer's ``score_sequences`` on the same token ids."""
    model = load_model(ModelConfig(path=tiny_model_dir, head="value")).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        model.score.weight.normal_()
    pairs = random_pairs(10, model.config.vocab_size, seed=5)
    cfg = TrainerConfig(micro_batch_tokens=64, row_tokens=32)
    trained = {}
    with torch.no_grad():
        for mb in pair_micro_batches(pairs, cfg, pad_id=0):
            head = model(
                input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False
            ).logits
            scores = completion_scores(head, mb)
            ids = mb.input_ids.reshape(-1)[mb.sequence_ids.reshape(-1) >= 0].tolist()
            offsets = [0]
            for n in mb.seq_lens:
                offsets.append(offsets[-1] + n)
            for j in range(len(mb.seq_lens)):
                trained[tuple(ids[offsets[j] : offsets[j + 1]])] = scores[j].item()
    seqs = [s.input_ids for p in pairs for s in p]
    scored = score_sequences(model, seqs, pad_id=0)
    assert len(set(scored)) > 10  # a random head: scores differ
    for s, value in zip(seqs, scored):
        assert trained[tuple(s)] == pytest.approx(value, abs=1e-5)


def write_pairs(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_pair_data_errors_name_the_line(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    path = tmp_path / "pairs.jsonl"
    write_pairs(
        path,
        [
            {"prompt": "1 + 2 =", "chosen": " 3", "rejected": " 4"},
            {"prompt": "1 + 3 =", "completion": " 4"},
        ],
    )
    with pytest.raises(
        Exception, match=r"pairs.jsonl:2: a preference row needs chosen and rejected"
    ):
        PairData(str(path), PromptRenderer(tokenizer), seed=0)


def addition_pairs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        wrong = a + b + rng.choice([-10, -1, 1, 10])
        rows.append({"prompt": f"{a} + {b} =", "chosen": f" {a + b}", "rejected": f" {wrong}"})
    return rows


@pytest.mark.parametrize("stage", ["rm", "dpo"])
def test_a_short_stage_run_through_the_launcher(stage, tiny_model_dir, tmp_path):
    """A few steps of each stage via launch/local.py: finite losses, held-out pair
    figures at the start and the end, an HF export that loads with the right head."""
    data = tmp_path / "data"
    write_pairs(data / "train.jsonl", addition_pairs(64, 0))
    write_pairs(data / "eval.jsonl", addition_pairs(16, 1))
    experiment = "tiny_rm.py" if stage == "rm" else "tiny_dpo.py"
    run_dir, export = tmp_path / "run", tmp_path / "export"
    overrides = [
        f"run_dir={run_dir}",
        f"model.path={tiny_model_dir}",
        f"export_dir={export}",
        f"data.train_path={data / 'train.jsonl'}",
        f"data.eval_path={data / 'eval.jsonl'}",
        "max_steps=4",
        "batch_size=8",
        "eval.every_steps=2",
        "eval.num_examples=10",
        "trainer.micro_batch_tokens=64",
        "trainer.row_tokens=32",
        "metrics.tensorboard=false",
        "metrics.progress_bar=false",
        "task.train_size=200",
        "task.eval_size=20",
    ]
    if stage == "dpo":
        overrides += ["reference=on_the_fly", "loss.nll_coef=0"]  # plain DPO: log 2 at the start
    out = subprocess.run(
        [sys.executable, "launch/local.py", f"experiments/{experiment}", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    prefix = "eval/pair_"
    assert set(summary["initial"]) >= {f"{prefix}loss", f"{prefix}accuracy"}
    assert math.isfinite(summary["final"][f"{prefix}loss"])
    if stage == "dpo":
        # the policy starts as its reference: log 2 on held-out pairs, and the task is evaluated
        assert summary["initial"][f"{prefix}loss"] == pytest.approx(math.log(2), abs=1e-4)
        assert "eval/accuracy" in summary["final"]
        assert summary["final"][f"{prefix}loss"] != pytest.approx(math.log(2), abs=1e-4)
    model = load_model(ModelConfig(path=str(export), head="value" if stage == "rm" else "lm"))
    assert model is not None


def test_pair_data_reads_a_parquet_file_through_the_field_map(tiny_model_dir, tmp_path):
    """Preference pairs of the common shape in a file of the user's, columns named their
    way: rendered as every stage renders prompts, each side through its end token."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncrl.tasks import Example, TaskConfig

    path = tmp_path / "prefs.parquet"
    rows = {"question": ["1 + 2 =", "2 + 2 ="], "good": [" 3", " 4"], "bad": [" 4", " 5"]}
    pq.write_table(pa.table(rows), path)
    task = TaskConfig(
        source="dataset",
        train_path=str(path),
        fields={"prompt": "question", "chosen": "good", "rejected": "bad"},
    )
    renderer = PromptRenderer(load_tokenizer(tiny_model_dir))
    data = PairData(str(path), renderer, seed=0, task_cfg=task)
    assert len(data) == 2
    chosen, rejected = data.pairs[1]
    prompt = renderer.prompt_ids(Example(uid="x", prompt="2 + 2 ="))
    assert chosen.input_ids == prompt + renderer.completion_ids(Example("x", ""), " 4")
    assert rejected.input_ids == prompt + renderer.completion_ids(Example("x", ""), " 5")
    assert chosen.loss_mask == [0] * len(prompt) + [1] * (len(chosen.input_ids) - len(prompt))
