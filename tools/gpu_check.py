"""The GPU machine's check of asyncrl's GPU paths, ending with ONE JSON line (run by
``tools/gpu_check.sh``, which prepares the environment first).

    python tools/gpu_check.py --out runs/gpu_check [--budget-s 500]

Each part runs in a child process with a time limit cut from what is left of the budget,
so one that hangs or faults (a CUDA error, an NCCL hang) costs only its own share, and
its result says what happened (``ok``, figures, ``error``, or ``skipped`` and why):

- ``model``: a ~0.47B-parameter Qwen2 (hidden 1024, 24 layers, GQA 16/4) with random
  init and the task's character tokenizer (``tools/make_tiny_model.py``).
- ``trainer``: TrainerCore's FSDP2 steps on CUDA over NCCL, fp32 master weights with bf16
  compute: finite, falling loss, step time, tokens/s, peak memory; ``trainer_<option>``
  again with each GPU-only option the trainer has (activation checkpointing, CPU offload).
- ``publish``: the trainer's gathered weights staged into the embedded engine on CUDA
  while it decodes, as a generator does: the flip lands between steps, later tokens carry
  the new version, and the engine's logprobs equal those of the trainer's weights.
- ``engine``: the embedded engine decoding on CUDA in bf16: tokens/s, and greedy agreement
  with transformers' forward on the same GPU.
- ``nccl``: the state dict broadcast in buckets from rank 0 to rank 1, the transport of
  ``NcclWeightPublisher`` (which also needs sglang servers): needs two GPUs, since NCCL
  refuses two ranks on one device (the trainer's steps above ran on NCCL, one rank).
- ``loop``: tiny_grpo through ``launch/local.py`` on CUDA for a minute, trainer and
  generator sharing the one GPU (``--share-gpus``; refused without it): the real publish
  path into the CUDA engine; its figures are ``tools/run_report.py``'s.
- ``gpu_tests``: ``pytest -m gpu`` but vLLM's (sglang's skip where it is not installed);
  ``vllm_tests``: vLLM's conformance and client tests against ``vllm serve``, where vllm
  imports, in what is left of the budget (each server takes a minute or two to start).

Without CUDA every part is skipped and the line says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VLLM_TESTS = [
    "tests/test_vllm_protocol.py",
    "tests/test_vllm_client.py",
    "tests/test_vllm_transfer.py",
]

MODEL_SHAPE = [
    "model.tiny.hidden_size=1024",
    "model.tiny.num_layers=24",
    "model.tiny.num_heads=16",
    "model.tiny.num_kv_heads=4",
    "model.tiny.intermediate_size=5504",
    "model.tiny.max_positions=1024",
]
LIMITS_S = {
    "model": 100,
    "trainer": 150,
    "engine": 80,
    "loop": 150,
    "nccl": 50,
    "gpu_tests": 100,
    "vllm_tests": 600,
}
"""Each part's own time limit; the budget's remainder cuts the later ones (vLLM's tests,
minutes of server starts, get what is left)."""
TESTS = ("gpu_tests", "vllm_tests")
"""Parts that are pytest runs: their result is pytest's summary line."""


# ---- the parent: children with time limits -------------------------------------------
def run_child(argv: list[str], limit_s: float, log: Path) -> tuple[int | None, str]:
    """(exit status, or None when killed at ``limit_s``; stdout). Its own process group, so
    a launcher's children go with it."""
    with open(log, "w") as err:
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=limit_s)
            return proc.returncode, out
        except subprocess.TimeoutExpired:
            for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                os.killpg(proc.pid, sig)
                try:
                    out, _ = proc.communicate(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    out = ""
            return None, out


def last_json(out: str) -> dict | None:
    for line in reversed(out.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def child_result(name: str, code: int | None, out: str, limit_s: float, log: Path) -> dict:
    """A child's results by part, or, under ``name``, what went wrong with it."""
    found = last_json(out)
    if code == 0 and found is not None:
        return found
    if code is None:
        return {name: {"ok": False, "error": f"timed out after {limit_s:.0f} s (log {log})"}}
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return {name: {"ok": False, "error": f"exit {code}: {' | '.join(tail)}"}}


def env_figures() -> dict:
    try:
        import torch
    except ImportError as e:  # the wrong interpreter: say so rather than fail
        return {"torch": None, "cuda_build": None, "cuda": False, "error": str(e)}
    cuda = torch.cuda.is_available()
    figures = {
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda": cuda,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
    }
    if cuda and torch.distributed.is_nccl_available():
        figures["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return figures


def gpu_test_files() -> list[str]:
    """The test files with tests marked ``gpu``, vLLM's apart (``vllm_tests``): collecting
    only these, a module that imports a package this machine lacks (``datasets``,
    ``openai``) does not fail the part."""
    marked = [p for p in sorted((ROOT / "tests").glob("test_*.py")) if "mark.gpu" in p.read_text()]
    return [str(p.relative_to(ROOT)) for p in marked if str(p.relative_to(ROOT)) not in VLLM_TESTS]


def plan(out: Path, model: Path) -> dict[str, list[str]]:
    """Each part's command line, in the order they run."""
    py, me = sys.executable, str(Path(__file__).resolve())
    loop = [
        "experiments/tiny_grpo.py",
        f"model.path={model}",
        f"run_dir={out / 'loop'}",
        "time_limit_s=60",
        "eval.every_steps=0",
        "trainer.device=cuda",
        "engine.embedded.device=cuda",
        "engine.embedded.max_slots=256",
        "task.rl_split=train",
        # A random-init model solves nothing: every group is uniform, and dynamic sampling
        # would drop nearly all of them and never fill a step.
        "buffer.dynamic_sampling=false",
        "metrics.tensorboard=false",
    ]
    return {
        "model": [py, "tools/make_tiny_model.py", "--out", str(model), "--force", *MODEL_SHAPE],
        "trainer": [py, me, "--child", "trainer", "--model", str(model), "--out", str(out)],
        "engine": [py, me, "--child", "engine", "--model", str(model), "--out", str(out)],
        "loop": [py, me, "--child", "loop", "--out", str(out), "--", *loop],
        "nccl": [py, me, "--child", "nccl", "--model", str(model), "--out", str(out)],
        "gpu_tests": [py, "-m", "pytest", "-q", "-m", "gpu", *gpu_test_files()],
        "vllm_tests": [py, "-m", "pytest", "-q", "-m", "gpu", *VLLM_TESTS],
    }


def run_all(out: Path, budget_s: float) -> dict:
    figures: dict = {"env": env_figures()}
    env = figures["env"]
    if not env["cuda"]:
        why = (
            f"torch does not import here: {env['error']}"
            if "error" in env
            else f"no CUDA device (torch {env['torch']}, CUDA build {env['cuda_build']})"
        )
        return {**figures, "ok": False, **{name: {"skipped": why} for name in LIMITS_S}}
    deadline = time.monotonic() + budget_s
    model = out / "model-0.5b"
    for name, argv in plan(out, model).items():
        left = deadline - time.monotonic()
        if name == "vllm_tests" and importlib.util.find_spec("vllm") is None:
            figures[name] = {"skipped": "vllm is not installed"}
            continue
        if left < 20:
            figures[name] = {"skipped": f"out of time ({budget_s:.0f} s budget)"}
            continue
        limit, log, start = min(LIMITS_S[name], left), out / f"{name}.log", time.monotonic()
        code, stdout = run_child(argv, limit, log)
        if name == "model":
            figures[name] = {"ok": code == 0, "path": str(model)}
        elif name in TESTS:
            summary = (stdout.strip().splitlines() or ["(no output)"])[-1]
            figures[name] = {"ok": code in (0, 5), "summary": summary}  # 5: none collected
        else:
            figures.update(child_result(name, code, stdout, limit, log))
        figures.setdefault(name, {})["seconds"] = round(time.monotonic() - start, 1)
    ran = [v for v in figures.values() if isinstance(v, dict) and "ok" in v]
    figures["ok"] = all(v["ok"] for v in ran)
    return figures


# ---- the children: each prints {part: result, ...} ---------------------------------
def child_main(name: str, model: str, out: Path, rest: list[str], device: str) -> dict:
    if name == "loop":
        return {"loop": loop_check(out, rest)}
    import gpu_check_parts as parts  # CUDA code: imported by the children only

    parts.DEVICE = device
    if name == "trainer":
        return parts.trainer_checks(model, out)
    if name == "engine":
        return {"engine": parts.engine_check(model)}
    return {"nccl": parts.nccl_check(model)}


def loop_check(out: Path, overrides: list[str]) -> dict:
    """tiny_grpo on this machine's GPUs; on one GPU, refused without ``--share-gpus`` (a
    trainer and a generator want two) and run with it."""
    import torch

    launch = [sys.executable, "launch/local.py", *overrides]
    result: dict = {}
    if torch.cuda.device_count() < 2:
        refused = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=60)
        result["refused_without_share"] = refused.returncode == 2 and "GPUs" in refused.stderr
        launch.append("--share-gpus")
    ran = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True)
    result["rc"] = ran.returncode
    if ran.returncode:
        result["error"] = ran.stderr.strip().splitlines()[-3:]
    report = subprocess.run(
        [sys.executable, "tools/run_report.py", str(out / "loop")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    figures = last_json(report.stdout) or {"report_error": report.stderr.strip()[-500:]}
    figures.pop("generators", None)
    ok = ran.returncode == 0 and (figures.get("steps") or 0) >= 2
    return {"ok": ok and result.get("refused_without_share", True), **result, **figures}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check")
    parser.add_argument("--budget-s", type=float, default=500.0, help="all parts together")
    parser.add_argument(
        "--child", choices=["trainer", "engine", "nccl", "loop"], help=argparse.SUPPRESS
    )
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    # A child's device: cpu runs its logic on a tiny model in the CPU tests.
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    random.seed(0)
    if args.child:
        print(
            json.dumps(child_main(args.child, args.model, args.out, args.rest, args.device)),
            flush=True,
        )
        return 0
    figures = run_all(args.out, args.budget_s)
    (args.out / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures), flush=True)
    return 0 if figures["ok"] or not figures["env"]["cuda"] else 1


if __name__ == "__main__":
    sys.exit(main())
