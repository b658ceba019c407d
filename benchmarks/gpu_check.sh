#!/usr/bin/env bash
# The whole check for the H200 machine, run from the repository root:
#
#     bash benchmarks/gpu_check.sh            # results under $OUT (default ./gpu_out)
#
# That machine has torch, triton 3.6 and transformers but no network and no pyzmq: wheels carried
# in .whl/ are installed into /tmp/site first. Each stage has its own timeout and writes
# $OUT/<stage>.log and $OUT/<stage>.json ({stage, rc, seconds, timed_out}); a failing stage is
# recorded and the next one still runs. $OUT/summary.json lists every stage. Under 5 minutes.
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

# (1) Kernel tests: compiled on the GPU first, then the CPU interpreter and sm_90 compile tiers.
stage gpu_kernel_tests 90 "$PY" -m pytest tests/kernels -q -m gpu -p no:cacheprovider \
    --junitxml="$OUT/gpu_kernel_tests.xml"
stage kernel_tests 110 "$PY" -m pytest tests/kernels -q -m "not slow and not gpu" -p no:cacheprovider \
    --junitxml="$OUT/kernel_tests.xml"

# (2) Kernel micro-benchmarks: decode KV bandwidth against a device copy, store_kv, gather/scatter.
stage kernel_bench 90 "$PY" benchmarks/kernels.py --json "$OUT/kernels.json"

# (3) The engine on the GPU: parity tests, then the offline benchmark on a Llama-3.2-1B-shaped
# random bf16 model with the nano-vllm workload (input and output lengths uniform in 100..1024).
stage gpu_engine_tests 90 "$PY" -m pytest tests/engine/test_gpu_engine.py -q -s -p no:cacheprovider
stage make_llama1b 60 "$PY" benchmarks/make_random_model.py --shape llama-1b --dtype bfloat16 --out /tmp/llama1b
stage offline_256 100 "$PY" benchmarks/offline.py --model /tmp/llama1b --device cuda --dtype bfloat16 \
    --num-requests 256 --input-len 100 1024 --output-len 100 1024 --skip-hf --quiet --json "$OUT/offline_256.json"
stage offline_vs_hf_128 150 "$PY" benchmarks/offline.py --model /tmp/llama1b --device cuda --dtype bfloat16 \
    --num-requests 128 --input-len 100 1024 --output-len 100 1024 --quiet --json "$OUT/offline_vs_hf_128.json"

# (4) The KV hand-off on the GPU: CUDA IPC between processes, then the pool-to-pool copy rate for a
# 2,048-token request of the 1B shape (16 layers, 8 KV heads, head dim 64, bf16).
stage cuda_ipc_tests 60 "$PY" -m pytest tests/kvtransfer/test_cuda_ipc.py -q -p no:cacheprovider
stage kv_transfer_bench 60 "$PY" benchmarks/kv_transfer.py --json "$OUT/kv_transfer.json"
stage gpu_disagg_e2e 150 "$PY" -m pytest tests/e2e/test_gpu_disagg.py -q -p no:cacheprovider

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
