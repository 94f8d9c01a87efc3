"""Memory that shards: the trainer's meta-device loading equals ``load_model``, the
sharded KL reference gives the unsharded one's logprobs, activation checkpointing changes
no loss or gradient, CPU offload is refused on a CPU trainer, and a fixed mmap threshold
gives freed tensors back to the system. The two-rank checks of
the same loading are in ``test_trainer.py`` (``fsdp_worker``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Qwen2Config

from asyncrl.config import ConfigError
from asyncrl.launcher.prepare import resolve
from asyncrl.loop.batch import add_reference_logprobs
from asyncrl.models import ModelConfig, load_model
from asyncrl.trainer.config import OptimConfig, TrainerConfig
from asyncrl.trainer.core import TrainerCore, frozen_model, sharded_model
from asyncrl.trainer.packing import make_micro_batches

from .conftest import full_grads
from .fsdp_worker import REFERENCE_TEMPERATURE, loss_fn, probe_ids, run_ranks, synthetic_sequences


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """A tiny random Qwen2 whose LM head is its embedding (as Qwen2.5-0.5B's)."""
    config = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    out = tmp_path_factory.mktemp("tied")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return str(out)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


@pytest.mark.parametrize("kind", ["lm", "tied", "value"])
def test_sharded_loading_equals_load_model(dist_info, tiny_model_dir, tied_model_dir, kind):
    """Same state (the value model's missing head zero, the tie kept), same logits."""
    path = tied_model_dir if kind == "tied" else tiny_model_dir
    cfg = ModelConfig(path=path, head="value" if kind == "value" else "lm")
    sharded, plain = sharded_model(cfg, dist_info), load_model(cfg)
    state, expected = full_state(sharded), plain.state_dict()
    assert state.keys() == expected.keys()
    for name in expected:
        assert torch.equal(state[name], expected[name]), name
    if kind == "tied":
        assert sharded.lm_head.weight is sharded.model.embed_tokens.weight
    if kind == "value":
        assert not state["score.weight"].any()
    buffers = dict(plain.named_buffers())  # recomputed, never loaded: the rotary frequencies
    for name, buffer in sharded.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    ids = probe_ids(plain.config.vocab_size)
    with torch.no_grad():
        logits = sharded(ids, use_cache=False).logits
        assert torch.equal(logits, plain(ids, use_cache=False).logits)


def test_the_sharded_reference_gives_the_unsharded_logprobs(dist_info, tiny_model_dir):
    cfg = ModelConfig(path=tiny_model_dir)
    reference = frozen_model(cfg, dist_info)
    assert not any(p.requires_grad for p in reference.parameters())
    seqs = synthetic_sequences(10, reference.config.vocab_size, seed=5)
    sharded = make_micro_batches(seqs, 64, row_tokens=64)
    plain = make_micro_batches(seqs, 64, row_tokens=64)
    assert len(sharded) > 1
    add_reference_logprobs(reference, sharded, dist_info.device, 0.7)
    # Resharded after the pass: it holds no gathered copy of its embedding meanwhile.
    assert all(isinstance(p, DTensor) for p in reference.parameters())
    add_reference_logprobs(load_model(cfg).eval(), plain, dist_info.device, 0.7)
    for a, b in zip(sharded, plain, strict=True):
        assert torch.equal(a.fields["reference"], b.fields["reference"])


def test_activation_checkpointing_gives_the_same_loss_and_grads(dist_info, tiny_model_dir):
    """Each decoder layer's MLP runs twice per micro-batch (forward, then its recompute in
    the backward) and the loss and every gradient are those without checkpointing."""
    frozen = OptimConfig(lr=0.0, warmup_steps=0, schedule="constant", max_grad_norm=0.0)
    cfg = ModelConfig(path=tiny_model_dir)
    plain = TrainerCore(cfg, TrainerConfig(), frozen, dist_info, 0)
    ac_cfg = TrainerConfig(activation_checkpointing=True)
    checkpointed = TrainerCore(cfg, ac_cfg, frozen, dist_info, 0)
    calls = []
    mlp = checkpointed.model.model.layers[0].mlp
    mlp_forward = mlp.forward  # a hook would not see the recompute: count the calls

    def counted(*args, **kwargs):
        calls.append(1)
        return mlp_forward(*args, **kwargs)

    mlp.forward = counted
    micro = make_micro_batches(
        synthetic_sequences(8, plain.model.config.vocab_size), 128, row_tokens=64
    )
    expected, got = plain.train_step(micro, loss_fn), checkpointed.train_step(micro, loss_fn)
    assert len(calls) == 2 * len(micro)
    assert got.loss == pytest.approx(expected.loss, rel=1e-6)
    grads = full_grads(plain.model)
    ac_grads = full_grads(checkpointed.model)
    assert ac_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(ac_grads[name], grad, atol=1e-7, rtol=1e-5, msg=name)
    assert set(checkpointed.full_state_dict()) == set(plain.full_state_dict())


def test_cpu_offload_is_refused_on_a_cpu_trainer(dist_info, tiny_model_dir):
    with pytest.raises(ValueError, match="cpu_offload"):
        sharded_model(ModelConfig(path=tiny_model_dir), dist_info, TrainerConfig(cpu_offload=True))


@pytest.mark.parametrize("kind", ["lm", "tied"])
def test_two_ranks_load_what_load_model_loads(tiny_model_dir, tied_model_dir, tmp_path, kind):
    """Each of two ranks allocates only its shards, yet the gathered state and the probe's
    logits are ``load_model``'s, and the sharded reference's logprobs on each rank's
    micro-batches (three on rank 0, one on rank 1) are the unsharded reference's."""
    path = tied_model_dir if kind == "tied" else tiny_model_dir
    result = run_ranks(2, path, tmp_path, steps=1)
    plain = load_model(ModelConfig(path=path)).eval()
    expected = plain.state_dict()
    assert result["loaded"].keys() == expected.keys()
    for name in expected:
        assert torch.equal(result["loaded"][name], expected[name]), name
    with torch.no_grad():
        logits = plain(probe_ids(plain.config.vocab_size), use_cache=False).logits
    torch.testing.assert_close(result["probe"], logits, atol=1e-6, rtol=1e-6)
    counts = []
    for rank in range(2):
        sharded = torch.load(tmp_path / f"result_2.pt.reference{rank}", weights_only=False)
        counts.append(len(sharded))
        for mb in sharded:
            got = mb.fields.pop("reference")
            add_reference_logprobs(plain, [mb], torch.device("cpu"), REFERENCE_TEMPERATURE)
            torch.testing.assert_close(got, mb.fields["reference"], atol=1e-6, rtol=1e-6)
    assert counts[0] > counts[1]


FREE_AFTER_HEAP_GROWTH = textwrap.dedent(
    """
    import sys
    import torch
    from asyncrl.trainer.dist import set_malloc_mmap_threshold

    def resident_mb():
        line = next(x for x in open("/proc/self/status") if x.startswith("VmRSS"))
        return int(line.split()[1]) / 1024

    set_malloc_mmap_threshold(int(sys.argv[1]))
    big = torch.ones(4 << 20)  # 16 MiB, mapped; freeing it raises glibc's own threshold
    del big
    start = resident_mb()
    pair = [torch.ones(2 << 20), torch.ones(2 << 20)]  # 8 MiB each
    del pair
    print(resident_mb() - start)
    """
)


@pytest.mark.parametrize("threshold", [0, 131072])
def test_a_fixed_mmap_threshold_returns_freed_tensors_to_the_system(threshold):
    """glibc's own threshold rises past a freed 16 MiB tensor, so the next 8 MiB ones come
    from the heap and stay resident when freed; at a fixed 128 KiB they are unmapped."""
    out = subprocess.run(
        [sys.executable, "-c", FREE_AFTER_HEAP_GROWTH, str(threshold)],
        capture_output=True,
        text=True,
        check=True,
    )
    held_mb = float(out.stdout)
    assert held_mb > 12 if threshold == 0 else held_mb < 2


@pytest.mark.parametrize("threshold", [-1, 64 << 20])
def test_an_mmap_threshold_glibc_cannot_take_is_a_config_error(threshold):
    with pytest.raises(ConfigError, match="malloc_mmap_threshold"):
        TrainerConfig(malloc_mmap_threshold=threshold)
    with pytest.raises(ConfigError, match="malloc_mmap_threshold"):  # before any process
        resolve("experiments/longtail_grpo.py", [f"trainer.malloc_mmap_threshold={threshold}"])
