#!/usr/bin/env bash
# A short loan of a GPU machine in one command: `make gpu-check`, then nano-vLLM's benchmark on
# Qwen3-0.6B's shape (synchronous and async scheduling, with the profile) and on SmolLM2-135M's.
# Each stage has its own time limit, so one that hangs cannot take the others' time, and the reports
# and logs are copied to OUTDIR after each stage, so a call cut short keeps what it measured.
#
#   bash bench/gpu_session.sh OUTDIR            # on the GPU machine, in the repository's root
#   bash bench/gpu_session.sh OUTDIR --dry-run  # anywhere: gpu-check's CPU parts and the --tiny benchmark
#
# It uses the machine's own python3 and torch (GPU_PYTHON picks another), and random weights of the
# models' shapes: the GGUF does not travel to a machine that takes 64 MiB a call.
set -u -o pipefail
out=${1:?usage: bash bench/gpu_session.sh OUTDIR [--dry-run]}
dry=${2:-}
python=${GPU_PYTHON:-python3}
mkdir -p "$out" reports/gpu
export PYTHONPATH=$PWD:$PWD/course${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
start=$(date +%s)
status=0

stage() {  # stage NAME SECONDS COMMAND...: run it under its limit, log it, copy the new reports
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s, $(($(date +%s) - start)) s into the session)"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local code=${PIPESTATUS[0]}
    [ "$code" -eq 0 ] || { echo "== $name ended with status $code"; status=1; }
    find reports/gpu -name '*.md' -newer "$out/.started" -exec cp {} "$out/" \;
}

touch "$out/.started"
if [ "$dry" = "--dry-run" ]; then
    stage gpu-check 300 "$python" bench/gpu_check.py --dry-run --model random --out "$out"
    stage bench-qwen3 300 "$python" bench/bench_nanovllm.py --tiny --model qwen3-0.6b --hf-requests 4
else
    stage gpu-check 240 "$python" bench/gpu_check.py --model random --no-notebooks
    stage bench-qwen3 270 "$python" bench/bench_nanovllm.py --model qwen3-0.6b --profile
    stage bench-smollm2 150 "$python" bench/bench_nanovllm.py --model smollm2-135m
fi
rm -f "$out/.started"
echo "== done in $(($(date +%s) - start)) s; in $out: $(ls "$out" | tr '\n' ' ')"
exit $status
