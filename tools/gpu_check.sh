#!/usr/bin/env bash
# One prepared check for a GPU machine (torch with CUDA, transformers; no sglang, no
# internet), from the repository root, in under ten minutes; its last line is ONE JSON line:
#
#   OUT=runs/gpu_check bash tools/gpu_check.sh
#
# 1. installs asyncrl's other dependencies from ./wheels when that folder exists. Make it
#    on a connected machine with the GPU machine's Python (3.12 there) and carry it:
#      python3.12 -m venv /tmp/w && /tmp/w/bin/pip wheel -w wheels $DEPS && rm wheels/numpy-*
#    (`pip wheel`, not `pip download --only-binary`: reasoning-gym needs pycosat, cellpylib
#    and zss, published as sources only, built here into wheels for that Python; numpy is
#    there already). About 49 MB, under the 64 MiB a device run carries;
# 2. runs tools/gpu_check.py: a ~0.47B model, bf16 FSDP2 steps on CUDA over NCCL (with
#    activation checkpointing and CPU offload), the trainer's weights published into the
#    CUDA engine mid-decode, the engine's bf16 decoding, an NCCL broadcast (two GPUs),
#    tiny_grpo on the GPU through launch/local.py, and the `gpu` tests; each part with its
#    own time limit. Figures: $OUT/figures.json, logs: $OUT/*.log.
# Without CUDA it says so in the JSON line and exits 0.
set -uo pipefail
OUT=${OUT:-runs/gpu_check}
PY=${PYTHON:-python3}  # an interpreter with torch (CUDA build) and transformers
BUDGET_S=${BUDGET_S:-500}  # the parts; with pip and the margins, under ten minutes
DEPS="msgspec pyzmq aiohttp reasoning-gym tqdm hypothesis pytest math-verify"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ -d wheels ]; then
    echo "[gpu_check] installing dependencies from ./wheels" >&2
    timeout 120 $PY -m pip install -q --no-index --find-links wheels $DEPS > "$OUT/pip.txt" 2>&1 \
        || echo "[gpu_check] pip install failed (see $OUT/pip.txt)" >&2
fi
# The budget covers the parts; the margin covers starting Python and writing the figures.
timeout $((BUDGET_S + 30)) $PY tools/gpu_check.py --out "$OUT" --budget-s "$BUDGET_S" \
    > "$OUT/gpu_check.out" 2> "$OUT/gpu_check.err"
rc=$?
line=$(tail -n 1 "$OUT/gpu_check.out")
if [[ "$line" == "{"* ]]; then
    echo "$line"
else  # it could not say for itself what happened
    err=$(tail -c 300 "$OUT/gpu_check.err" | tr '\n"\\' '   ')
    echo "{\"ok\": false, \"error\": \"tools/gpu_check.py exited $rc: $err\"}"
fi
exit "$rc"
