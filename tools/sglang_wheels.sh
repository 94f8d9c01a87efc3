#!/usr/bin/env bash
# sglang's own request types and route table, per pinned release, for the conformance
# tests (tests/test_sglang_wheels.py). sglang has no CPU build, and its modules do not
# import without triton and a torchvision built for the exact torch, so the tests parse
# three source files of each released wheel instead: its route table
# (srt/entrypoints/http_server.py), its request structs (srt/managers/io_struct.py) and
# its SamplingParams (srt/sampling/sampling_params.py). This fetches each pinned wheel
# (`pip download --no-deps`, checked against its pinned sha256) and keeps only those:
#
#   tools/sglang_wheels.sh        # fetches what is missing; prints the cache folder
#
#   $DIR/sglang-VERSION/{http_server,io_struct,sampling_params}.py, and SOURCE (the
#   wheel's name and sha256, written last: a folder without it is fetched again)
#
# The wheels themselves are deleted (about 100 MB for the four); the cache keeps ~1 MB.
# Nothing of sglang is committed: the folder is ignored by git.
#
# Variables: SGLANG_WHEELS_DIR (default .sglang-wheels), SGLANG_VERSIONS (default: all
# pinned), PYTHON (the interpreter whose pip fetches; default .venv/bin/python, else
# python3).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${SGLANG_WHEELS_DIR:-.sglang-wheels}
VERSIONS=${SGLANG_VERSIONS:-0.5.10 0.5.20 0.5.21 0.5.23}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

# The wheel pip picks for CPython 3.11 on x86-64 Linux (0.5.10's is pure Python).
sha256() {
    case "$1" in
        0.5.10) echo ac8855a5d57dac8831fee526bca5212f1ae451f378e2ab08b3baecbc4deb4076 ;;
        0.5.20) echo 1573527042f4f6b4ead838302818595fc77fdc611dbcc2e40cd150fbc8f8513c ;;
        0.5.21) echo 96c029f75dec99baa33a5db3d41b1bebefdd6bcfba3a2f7c807fe1cf49a87c20 ;;
        0.5.23) echo 00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937 ;;
        *) echo "[sglang_wheels] sglang $1 is not pinned (add its sha256 here)" >&2; return 1 ;;
    esac
}

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

fetch() {
    local version=$1 out=$DIR/sglang-$1 want tmp=$TMP/$1
    [ -f "$out/SOURCE" ] && return 0
    want=$(sha256 "$version")
    "$PY" -m pip download -q --retries 2 --timeout 60 --no-deps --only-binary=:all: \
        --python-version 3.11 --platform manylinux_2_34_x86_64 "sglang==$version" -d "$tmp"
    mkdir -p "$out"
    "$PY" - "$tmp" "$out" "$want" <<'EOF'
import hashlib
import pathlib
import sys
import zipfile

tmp, out, want = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
(wheel,) = tmp.glob("sglang-*.whl")
digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
if digest != want:
    sys.exit(f"[sglang_wheels] {wheel.name}: sha256 {digest}, pinned {want}")
with zipfile.ZipFile(wheel) as zf:
    for member in ("entrypoints/http_server.py", "managers/io_struct.py",
                   "sampling/sampling_params.py"):
        name = member.rsplit("/", 1)[1]
        (out / name).write_bytes(zf.read(f"sglang/srt/{member}"))
(out / "SOURCE").write_text(f"{wheel.name} sha256={digest}\n")
EOF
    echo "[sglang_wheels] sglang $version: $(cat "$out/SOURCE")" >&2
}

for version in $VERSIONS; do
    fetch "$version"
done
echo "$DIR"
