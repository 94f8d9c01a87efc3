"""The check after a flip: the engine's probe logprobs equal the model's; a generator's
report over a real socket matches the trainer's for the weights it flipped in, and
weights that differ raise the alarm (and stop the run with ``probe_stop``)."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from asyncrl.buffer.config import RolloutConfig
from asyncrl.config import ConfigError, apply_overrides
from asyncrl.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from asyncrl.models import ModelConfig, load_model
from asyncrl.stages.rl_config import RLExperiment
from asyncrl.trainer.probe import TrainerProbe
from asyncrl.weights.probe import FlipProbe, policy_logprobs, probe_tokens

TEXT = "12+34=46 and 7*8=56"


def test_the_engine_scores_the_probe_as_the_model_does(tiny_model_dir):
    tokens = probe_tokens(tiny_model_dir, TEXT)
    engine = EmbeddedEngine(tiny_model_dir, EmbeddedEngineConfig(max_slots=1, max_seq_len=64))
    version, scored = engine.score(tokens)
    expected = policy_logprobs(load_model(ModelConfig(path=tiny_model_dir)), tokens, "cpu")
    assert version == 0 and len(scored) == len(tokens) - 1
    torch.testing.assert_close(torch.tensor(scored), expected, atol=1e-5, rtol=0)


def test_a_probe_shorter_than_two_tokens_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="at least 2"):
        probe_tokens(tiny_model_dir, "1")


def _report(flip: FlipProbe, trainer: TrainerProbe, model, engine, weights, version: int):
    """Flip ``weights`` in as ``version``, let the generator report, and have the trainer
    score its own model as ``version`` and compare; the trainer's scalars."""
    engine.stage_weights(weights, version, wait=True)
    flip.after_step(engine.status().version)
    assert trainer.pull.poll(10_000), "no report arrived"
    time.sleep(0.05)
    return trainer.after_publish(model, version)


def test_reports_match_the_trainer_and_other_weights_raise_the_alarm(
    tmp_path, tiny_model_dir, dist_info
):
    cfg = RolloutConfig(run_dir=str(tmp_path), run_id="probe")
    cfg.model = ModelConfig(path=tiny_model_dir)
    cfg.transport.weights.probe_text = TEXT
    model = load_model(ModelConfig(path=tiny_model_dir))
    engine = EmbeddedEngine(tiny_model_dir, EmbeddedEngineConfig(max_slots=1, max_seq_len=64))
    trainer = TrainerProbe(cfg.site(), cfg.model.path, dist_info, lineage="L")
    ctx = zmq.Context()
    lineage = ["L"]
    flip = FlipProbe(cfg.site(), cfg.model.path, "g0", engine, ctx, lambda: lineage[0])
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        same = _report(flip, trainer, model, engine, dict(state), 1)
        assert same["weights/probe_reports"] == 1 and same["weights/probe_alarms"] == 0
        assert same["weights/probe_max_abs_diff"] < 1e-5
        # bf16 on the wire: rounding, below the default alarm.
        rounded = {n: t.to(torch.bfloat16) for n, t in state.items()}
        bf16 = _report(flip, trainer, model, engine, rounded, 2)
        assert 0 < bf16["weights/probe_max_abs_diff"] < cfg.transport.weights.probe_alarm
        assert bf16["weights/probe_alarms"] == 0
        # The engine runs other weights than the trainer published: the alarm.
        wrong = dict(state)
        wrong["model.norm.weight"] = state["model.norm.weight"] * 3
        alarmed = _report(flip, trainer, model, engine, wrong, 3)
        assert alarmed["weights/probe_max_abs_diff"] > cfg.transport.weights.probe_alarm
        assert alarmed["weights/probe_alarms"] == 1
        # Another trainer's weights (a restarted one's lineage) are not compared.
        lineage[0] = "other"
        ignored = _report(flip, trainer, model, engine, wrong, 4)
        assert "weights/probe_reports" not in ignored and ignored["weights/probe_alarms"] == 1
        lineage[0] = "L"
        cfg.transport.weights.probe_stop = True
        with pytest.raises(RuntimeError, match="probe_stop"):
            _report(flip, trainer, model, engine, wrong, 5)
    finally:
        flip.close()
        trainer.close()
        engine.close()
        ctx.destroy(linger=0)


def test_a_probe_where_no_generator_can_score_it_fails_before_the_run(tmp_path):
    for placement in (["placement=colocated"], ["engine.backend=remote"]):
        cfg = RLExperiment(run_dir=str(tmp_path))
        apply_overrides(cfg, [f"transport.weights.probe_text={TEXT}", *placement])
        with pytest.raises(ConfigError, match="probe_text"):
            cfg.finalize()
