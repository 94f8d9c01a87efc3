#!/usr/bin/env bash
# One prepared check for a GPU machine: torch, transformers and tensorboard installed, no
# sglang, no internet. Run from the repository root; it stays under 8 minutes (15 with vllm):
#
#   OUT=runs/gpu_check bash tools/gpu_check.sh
#
# 1. installs asyncrl's other dependencies from ./wheels when that folder exists (make it
#    on a connected machine of the same Python with
#    `pip download -d wheels msgspec pyzmq aiohttp reasoning-gym tqdm hypothesis pytest`);
# 2. builds a ~0.47B-parameter Qwen2 (hidden 1024, 24 layers, GQA 16/4, MLP 5504) from a
#    config with random init and the task's character tokenizer;
# 3. runs the tests marked `gpu` (sglang ones skip: no sglang here), then, where vllm
#    imports, the vLLM conformance and client tests against real `vllm serve` (own timeout:
#    vLLM takes a minute or two to start);
# 4. runs the engine, trainer and loop benchmarks on that model on the GPU;
# 5. writes every figure to $OUT/figures.json (and prints it as one JSON line).
# Each part has its own timeout, so one that hangs cannot eat the others' time.
set -uo pipefail
OUT=${OUT:-runs/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
begin=$(date +%s)
say() { echo "[gpu_check $(( $(date +%s) - begin ))s] $*"; }

if [ -d wheels ]; then
    say "installing dependencies from ./wheels"
    $PY -m pip install -q --no-index --find-links wheels msgspec pyzmq aiohttp reasoning-gym tqdm \
        hypothesis pytest > "$OUT/pip.txt" 2>&1 || say "pip install failed (see $OUT/pip.txt)"
fi
$PY - <<'PY' > "$OUT/env.json"
import json, torch, transformers
print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                  "cuda": torch.cuda.is_available(),
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))
PY
say "env: $(cat "$OUT/env.json")"

MODEL="$OUT/model-0.5b"
say "building the model"
timeout 120 $PY tools/make_tiny_model.py --out "$MODEL" --force model.tiny.hidden_size=1024 \
    model.tiny.num_layers=24 model.tiny.num_heads=16 model.tiny.num_kv_heads=4 \
    model.tiny.intermediate_size=5504 model.tiny.max_positions=1024 > "$OUT/model.txt" 2>&1

say "gpu tests"
timeout 150 $PY -m pytest -q -m gpu -k "not vllm" tests > "$OUT/gpu_tests.txt" 2>&1
echo $? > "$OUT/gpu_tests.rc"

if $PY -c "import vllm" 2> /dev/null; then
    say "vllm tests (vllm $($PY -c 'import vllm; print(vllm.__version__)'))"
    timeout 420 $PY -m pytest -q -m gpu tests/test_vllm_protocol.py tests/test_vllm_client.py \
        > "$OUT/vllm_tests.txt" 2>&1
    echo $? > "$OUT/vllm_tests.rc"
else
    say "no vllm here: its tests skipped"
fi

say "engine benchmark"
timeout 100 $PY tools/bench_engine.py --model "$MODEL" --runs 1 --requests 128 --concurrency 64 \
    --latency-steps 40 2> "$OUT/engine.err" | tail -1 > "$OUT/engine.json"

say "trainer benchmark"
timeout 100 $PY tools/bench_trainer.py --model "$MODEL" --rounds 2 --steps 2 --batch 64 \
    --micro-batch-tokens 16384 --row-tokens 1024 2> "$OUT/trainer.err" | tail -1 > "$OUT/trainer.json"

say "loop benchmark: tiny_grpo on the 0.5B model, 90 s"
timeout 170 $PY launch/local.py experiments/tiny_grpo.py model.path="$MODEL" run_dir="$OUT/loop" \
    time_limit_s=90 eval.every_steps=0 trainer.device=cuda engine.embedded.device=cuda \
    engine.embedded.max_slots=256 task.rl_split=train metrics.tensorboard=false > "$OUT/loop.txt" 2>&1
$PY tools/run_report.py "$OUT/loop" > "$OUT/loop.json" 2>> "$OUT/loop.txt"

$PY - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def read(name):
    try:
        return json.loads((out / name).read_text().strip().splitlines()[-1])
    except Exception as e:  # a part that failed: say so in the figures
        return {"error": f"{type(e).__name__}: {e}"}
tests = (out / "gpu_tests.txt").read_text().strip().splitlines() if (out / "gpu_tests.txt").exists() else []
figures = {"env": read("env.json"), "gpu_tests": tests[-1] if tests else None,
           "gpu_tests_rc": (out / "gpu_tests.rc").read_text().strip() if (out / "gpu_tests.rc").exists() else None,
           "vllm_tests": (out / "vllm_tests.txt").read_text().strip().splitlines()[-1:] if (out / "vllm_tests.txt").exists() else None,
           "vllm_tests_rc": (out / "vllm_tests.rc").read_text().strip() if (out / "vllm_tests.rc").exists() else None,
           "engine": read("engine.json"), "trainer": read("trainer.json"), "loop": read("loop.json")}
figures["loop"].pop("generators", None)
(out / "figures.json").write_text(json.dumps(figures, indent=1))
print(json.dumps(figures))
PY
say "done"
