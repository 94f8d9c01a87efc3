"""Generators join and leave a running run through the real local launcher: one more is
started when ``RUN_DIR/control/generators`` asks for two, it takes leases and sends
tokens, and asking for one again drains it: it hands its leases back and is not
restarted. The run trains on with the first one until the test stops it, and the buffer's
books balance: nothing lost, nothing taken back for a dead holder, no token wasted."""

from __future__ import annotations

from tests.runs import (
    assert_drained_and_balanced,
    generated_by,
    run_then_stop,
    short_grpo_command,
    trained_steps,
    wait_for,
)


def test_a_generator_joins_and_leaves_a_running_run_losing_nothing(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    cmd = short_grpo_command(
        run_dir,
        tiny_model_dir,
        # Runs until the test stops it (the tiny model trains ~10 steps a second, and a
        # generator takes seconds to start): the limit only bounds a broken run.
        "rl.max_steps=1000000",
        "time_limit_s=600",
        "metrics.interval_s=0.5",
        "num_generators=1",
    )
    control = run_dir / "control" / "generators"

    def steps(lines: list[str]) -> None:
        wait_for(lambda: trained_steps(run_dir) >= 2, 120, "a trained step", 0.2)
        control.write_text("2\n")
        wait_for(lambda: generated_by(run_dir, "generator_g1") > 0, 120, "g1's tokens", 0.2)
        control.write_text("1\n")
        wait_for(lambda: any("generator_1 left the run" in x for x in lines), 120, "g1 to go", 0.2)
        after = trained_steps(run_dir)
        wait_for(lambda: trained_steps(run_dir) >= after + 5, 120, "steps after g1 left", 0.2)

    code, out = run_then_stop(cmd, steps)
    assert code == 130, out[-3000:]  # stopped by the test, as asked
    assert "generators: started generator_1 (wanted: 2)" in out
    assert "generators: draining generator_1 (wanted: 1)" in out
    assert "generator_1 left the run, drained" in out and "restart" not in out, out[-3000:]
    assert_drained_and_balanced(run_dir, "g1")
