#!/usr/bin/env bash
# The whole check for the H200 machine, run from the repository root:
#
#     bash benchmarks/gpu_check.sh            # results under $OUT (default ./gpu_out)
#
# That machine has torch, triton 3.6 and transformers but no network and no pyzmq: wheels carried
# in .whl/ are installed into /tmp/site first. Each stage has its own timeout and writes
# $OUT/<stage>.log and $OUT/<stage>.json ({stage, rc, seconds, timed_out}); a failing stage is
# recorded and the next one still runs. $OUT/summary.json lists every stage.
#
# Budget: the stage limits below sum to 300 s, so the script ends within 5 minutes (plus up to
# 10 s of --kill-after per stage that ignores SIGTERM). None of them has been timed on the H200 yet.
#
#     stage                    limit  what
#     gpu_kernel_tests           40   tests/kernels on the GPU (compiled Triton against torch)
#     gpu_engine_tests           45   engine parity on the GPU, decode CUDA graphs vs enforce_eager
#     kernel_bench               20   decode KV bandwidth, store_kv, gather/scatter (3 batches x 2 contexts)
#     make_llama1b               20   a random Llama-3.2-1B-shaped bf16 model in /tmp/llama1b
#     offline_graphs_vs_eager    35   decode-heavy offline run, CUDA graphs vs --enforce-eager
#     offline_256                30   256 requests, outputs 32..128 tokens, pdserve only
#     offline_vs_hf_128          40   128 requests, outputs 32..96 tokens, against transformers
#     cuda_ipc_tests             15   a peer process maps the KV pool by CUDA IPC handle
#     kv_transfer_bench          15   pool-to-pool KV copy rate, 2,048 tokens of the 1B shape
#     gpu_disagg_e2e             40   prefill + decode processes over CUDA IPC equal a colocated run
#     tp_tests                  (40)  tensor parallelism on NCCL: only with 2+ GPUs, else recorded
#                                     as skipped with the reason (the H200 machine has one GPU)
#                               ---
#                               300 (+40 with 2+ GPUs)
#
# The CPU tiers of tests/kernels (Triton interpreter, sm_90 compile) run in `make test` anywhere.
set -u

cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".whl/*.whl" > /dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; then
        export PYTHONPATH="/tmp/site:$PYTHONPATH"
    else
        echo "gpu_check: installing the carried wheels failed; stages needing them will fail" >&2
    fi
fi

STAGES=()

# stage NAME TIMEOUT_SECONDS COMMAND...: run it, keep its log, record how it ended.
stage() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (timeout ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local seconds=$((SECONDS - start))
    local timed_out=false
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then timed_out=true; fi
    printf '{"stage": "%s", "rc": %d, "seconds": %d, "timed_out": %s, "log": "%s"}\n' \
        "$name" "$rc" "$seconds" "$timed_out" "$OUT/$name.log" > "$OUT/$name.json"
    tail -n 3 "$OUT/$name.log"
    echo "== $name: rc=$rc in ${seconds}s"
    STAGES+=("$name")
}

# (1) Kernel tests, compiled on the GPU.
stage gpu_kernel_tests 40 "$PY" -m pytest tests/kernels -q -m gpu -p no:cacheprovider \
    --junitxml="$OUT/gpu_kernel_tests.xml"

# (2) The engine on the GPU: parity with transformers, then decode CUDA graphs against
# enforce_eager (same greedy tokens in float32 and bf16, replays counted).
stage gpu_engine_tests 45 "$PY" -m pytest tests/engine/test_gpu_engine.py tests/engine/test_cuda_graphs.py \
    -q -s -m gpu -p no:cacheprovider --junitxml="$OUT/gpu_engine_tests.xml"

# (3) Kernel micro-benchmarks: decode KV bandwidth against a device copy, store_kv, gather/scatter.
stage kernel_bench 20 "$PY" -m benchmarks.attention_bandwidth --batches 1 32 256 --contexts 1024 8192 --reps 5 \
    --json "$OUT/kernels.json"

# (4) Offline throughput on a Llama-3.2-1B-shaped random bf16 model: decode with CUDA graphs against
# --enforce-eager (short prompts, long outputs, so decode dominates), then the nano-vllm workload
# (inputs 100..1024 tokens) with outputs shortened to fit the budget, alone and against transformers.
stage make_llama1b 20 "$PY" -m benchmarks.make_random_model --shape llama-1b --dtype bfloat16 --out /tmp/llama1b
stage offline_graphs_vs_eager 35 "$PY" -m benchmarks.offline --model /tmp/llama1b --device cuda --dtype bfloat16 \
    --num-requests 64 --max-num-seqs 64 --input-len 16 64 --output-len 128 256 --skip-hf --vs-eager --quiet \
    --json "$OUT/offline_graphs_vs_eager.json"
stage offline_256 30 "$PY" -m benchmarks.offline --model /tmp/llama1b --device cuda --dtype bfloat16 \
    --num-requests 256 --input-len 100 1024 --output-len 32 128 --skip-hf --quiet --json "$OUT/offline_256.json"
stage offline_vs_hf_128 40 "$PY" -m benchmarks.offline --model /tmp/llama1b --device cuda --dtype bfloat16 \
    --num-requests 128 --input-len 100 1024 --output-len 32 96 --quiet --json "$OUT/offline_vs_hf_128.json"

# (5) The KV hand-off on the GPU: CUDA IPC between processes, then the pool-to-pool copy rate for a
# 2,048-token request of the 1B shape (16 layers, 8 KV heads, head dim 64, bf16).
stage cuda_ipc_tests 15 "$PY" -m pytest tests/kvtransfer/test_cuda_ipc.py -q -p no:cacheprovider
stage kv_transfer_bench 15 "$PY" -m benchmarks.kv_transfer --json "$OUT/kv_transfer.json"
stage gpu_disagg_e2e 40 "$PY" -m pytest tests/e2e/test_gpu_disagg.py -q -p no:cacheprovider

# (6) Tensor parallelism on NCCL (engine/parallel/): TP 2 against TP 1 offline, on as many GPUs as
# there are (at least 2). One GPU: the stage is recorded as skipped, with the reason.
NUM_GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${NUM_GPUS:-0}" -ge 2 ]; then
    stage tp_tests 40 "$PY" -m pytest tests/engine/test_tp_offline.py -q -m gpu -p no:cacheprovider
else
    echo "== tp_tests: skipped (tensor parallelism needs 2+ GPUs; this machine has ${NUM_GPUS:-0})"
    printf '{"stage": "tp_tests", "rc": 0, "seconds": 0, "timed_out": false, "skipped": "%s"}\n' \
        "tensor parallelism needs 2+ GPUs; this machine has ${NUM_GPUS:-0}" > "$OUT/tp_tests.json"
    STAGES+=("tp_tests")
fi

# Summary: every stage's record in one file; exit 1 when any stage failed.
failed=0
{
    echo "["
    sep=""
    for name in "${STAGES[@]}"; do
        printf '%s' "$sep"
        cat "$OUT/$name.json"
        sep=","
        grep -q '"rc": 0,' "$OUT/$name.json" || failed=1
    done
    echo "]"
} > "$OUT/summary.json"
cat "$OUT/summary.json"
exit "$failed"
