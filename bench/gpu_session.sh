#!/usr/bin/env bash
# A short loan of a GPU machine in one command: `make gpu-check`, then nano-vLLM's benchmark on
# Qwen3-0.6B's shape (synchronous and async scheduling, with the profile) and on SmolLM2-135M's.
# The whole run keeps within SESSION_SECONDS (default 540: one call on a lent machine may run 600),
# each stage within its own limit too, so one that hangs cannot take the others' time; the reports
# and logs are copied to OUTDIR after each stage, so a run cut short keeps what it measured.
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
budget=${SESSION_SECONDS:-540}
mkdir -p "$out" reports/gpu
export PYTHONPATH=$PWD:$PWD/course${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
start=$(date +%s)
status=0

stage() {  # stage NAME SECONDS COMMAND...: run it under its limit and what is left, log it, copy the reports
    local name=$1 limit=$2
    shift 2
    local left=$((budget - ($(date +%s) - start) - 15))  # 15 s kept for a kill and the copying
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then echo "== $name skipped: the session's time is spent"; status=1; return; fi
    echo "== $name (at most ${limit} s, $(($(date +%s) - start)) s into the session)"
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local code=${PIPESTATUS[0]}
    [ "$code" -eq 0 ] || { echo "== $name ended with status $code"; status=1; }
    find reports/gpu -name '*.md' -newer "$out/.started" -exec cp {} "$out/" \;
}

touch "$out/.started"
# What the stages import, first: a machine lacking one fails here in seconds, not after the first stage.
stage preflight 60 "$python" -c "import labkit.engine, labkit_course.roofline, transformers, triton, torch
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__,
      'cuda', torch.cuda.is_available())"
[ "$status" -eq 0 ] || { echo "== stopping: preflight failed"; exit 1; }
if [ "$dry" = "--dry-run" ]; then
    stage gpu-check 300 "$python" bench/gpu_check.py --dry-run --model random --out "$out"
    stage bench-qwen3 300 "$python" bench/bench_nanovllm.py --tiny --model qwen3-0.6b --hf-requests 4
else
    stage gpu-check 200 "$python" bench/gpu_check.py --model random --no-notebooks
    stage bench-qwen3 220 "$python" bench/bench_nanovllm.py --model qwen3-0.6b --profile
    stage bench-smollm2 150 "$python" bench/bench_nanovllm.py --model smollm2-135m
fi
rm -f "$out/.started"
echo "== done in $(($(date +%s) - start)) s; in $out: $(ls "$out" | tr '\n' ' ')"
exit $status
