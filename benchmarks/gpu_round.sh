#!/usr/bin/env bash
# The GPU round's measurements as one prepared script, for a GPU lent for minutes: each step under its own time limit,
# its whole output in $OUT/<step>.log (and its rows in $OUT/<step>.json), the tail on the terminal.
#   bash benchmarks/gpu_round.sh kernels     # Triton kernels' exactness, long prefill at 32k and 128k (~7 min)
#   bash benchmarks/gpu_round.sh tier        # pytest -m gpu, 8 processes (~3 min)
#   bash benchmarks/gpu_round.sh workloads   # the AIME-shaped stream; beside transformers' continuous batching;
#                                            # multi_request over one shared context (~6 min)
#   bash benchmarks/gpu_round.sh followup    # the tier; beside transformers (generate_batch before static); the
#                                            # stream's score-based row beside SnapStream on the same card (~9.5 min)
# Measured on an H100 (2026-11-27): the machine's start takes 1-2 min; a 15-minute lease holds about two phases.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-round}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
step() {
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - started)) s"
    tail -n 22 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
B=benchmarks
case ${1:-kernels} in
kernels)
    step triton_tests 150 python3 -m pytest -q -m gpu tests/test_gpu.py -k "triton or attention_sum_methods"
    step prefill_32k 140 python3 $B/bench_long_prefill.py --device cuda --shape 8b --lengths 32768 \
        --methods full h2o observed_attention --blockwise-too --json "$OUT/prefill_32k.json"
    step prefill_128k 120 python3 $B/bench_long_prefill.py --device cuda --shape 8b --lengths 131072 \
        --methods full h2o observed_attention --json "$OUT/prefill_128k.json"
    ;;
tier)
    step gpu_tier 170 python3 -m pytest -q -m gpu tests/test_gpu.py -n 8 -rf --durations=10
    ;;
workloads)
    step stream 180 python3 $B/bench_stream.py --device cuda --shape 8b --slots 48 --prompts 30 --repeats 2 \
        --fraction 0.03125 --methods snapstream h2o full --json "$OUT/stream.json"
    step vs_hf 100 python3 $B/bench_vs_hf_batching.py --device cuda --shape 8b --requests 64 --slots 32 --new 128 \
        --json "$OUT/vs_hf.json"
    step multi_request 80 python3 $B/bench_multi_request.py --device cuda --shape 8b --context 8192 --queries 32 \
        --slots 16 --json "$OUT/multi_request.json"
    ;;
followup)
    step gpu_tier 180 python3 -m pytest -q -m gpu tests/test_gpu.py -n 8 -rf --durations=5
    step vs_hf 160 python3 $B/bench_vs_hf_batching.py --device cuda --shape 8b --requests 64 --slots 32 --new 128 \
        --json "$OUT/vs_hf.json"
    step stream 220 python3 $B/bench_stream.py --device cuda --shape 8b --slots 48 --prompts 30 --repeats 2 \
        --fraction 0.03125 --methods snapstream h2o --json "$OUT/stream.json"
    ;;
esac
