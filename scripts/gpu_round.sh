#!/usr/bin/env bash
# One GPU round for the CUDA backend, run on the GPU machine from the repository root:
#
#   scripts/gpu_round.sh [stage…]     stages: info (the cards, and the host CPUs' noise:
#                                     scripts/host_noise.c) kernels model serve serve-quick parity
#                                     parity32 bench offline-bench profile latency-8b
#                                     kernel-bench graphs (decode latency, graphs vs --enforce-eager)
#                                     gemv (the thin-GEMM kernel's test, then its bench against cuBLAS)
#                                     gemm-bench (decode GEMMs at batch 1-32: thin_gemm against cuBLAS and gemv)
#                                     gemm-candidates (cuBLASLt's algorithms at batch 64-256, weights from HBM)
#                                     tp-gemv (one rank's batch-1 GEMMs at TP=2 and 4, one GPU)
#                                     tp-rank-latency (TPOT at TP=1 of one TP=$TP_MAX rank's shapes:
#                                     a rank's step without collectives; TP_SIZES="1 4" on one GPU)
#                                     decode-late (decode attention at small batches of long
#                                     sequences: each grid's plan against fixed partitions)
#                                     decode-mid (decode attention at nanovllm-256's batches of
#                                     64-128: the plan against fixed partitions)
#                                     decode-q-split (decode attention with each kv head's q heads
#                                     split over 1-8 blocks, the TP ranks' heads too)
#                                     kv-read-probe (decode attention's reads with no math, through
#                                     bulk copies, and contiguously: scripts/kv_read_probe.cu, nvcc)
#                                     long-context (TPOT at those batches; BASE_BIN alternates)
#                                     serve-bench (bench serve, 1000 x 512/128, rate inf and 16)
#                                     llama-8b (the Llama-3.1-8B shape at saturation)
#                                     batch-bench (decode steps at batch 256, then ncu per kernel;
#                                     VLLM_BENCH_MODEL=DIR and VLLM_BENCH_BATCH=N: another model and batch)
#                                     prefill-bench (a prefill step of ~7,900 tokens, then ncu per kernel)
#                                     sampling-bench (the sampler at batch 256, then ncu per case)
#                                     async-check (--async-scheduling vs serial through serve)
#                                     ENGINE_ARGS (e.g. --async-scheduling) go to the bench stages
#                                     tensor parallelism (2+ GPUs): tp-nccl tp-serve tp-latency
#                                     tp-throughput tp-70b tp-parity tp-parity32, at TP sizes
#                                     $TP_SIZES (default 1 2 4 8 up to the GPU count; the 70B
#                                     and NCCL-only runs take the largest)
#                                     tp-parity-0.6b (the Qwen3-0.6B shape, Qwen3-8B's tokenizer;
#                                     the largest TP also through NCCL alone, against the custom all-reduce)
#                                     tp-parity32-0.6b (the same in f32: every row token for token)
#                                     trained weights: gguf-parity (SmolLM2 GGUF vs transformers)
#                                     sanitize (compute-sanitizer over the kernel tests:
#                                     memcheck and initcheck on all, racecheck on attention
#                                     and the small kernels; about 7 minutes, so set
#                                     STAGE_TIMEOUT=580 and run it alone in its call)
#                                     reliability: soak (scripts/soak.sh on the Qwen3-0.6B shape,
#                                     $SOAK_SECONDS, default 480; set STAGE_TIMEOUT above it)
#                                     (default: info kernels kernel-bench model serve parity bench)
#
# It runs prebuilt binaries from .gpu/ (built on the development machine, see
# docs/CUDA_NOTES.md): vllm-rs (or $BIN, to run another build's stages in the same call),
# cuda_kernels, cuda_nvrtc, cuda_bench, worker_tests, and the model
# configs in .gpu/models/<name>/config.json. Random model folders are generated here.
# gguf-parity reads $G/SmolLM2-135M-Instruct.Q4_1.gguf, or joins $G/smollm2.part* into it,
# and installs the `gguf` wheel from $G/wheels if transformers cannot import it. A call
# carries at most 64 MiB and the device's tree keeps only what the call carries, so the
# 98 MB file comes over in parts: earlier calls copy their part (and the binary) to
# /dev/shm, and the last one copies them back into $G before this runs.
# Each stage's full output goes to $LOG/<stage>.log (packed into $OUT/logs.tgz when $OUT
# is set, as on the device machine); a short table is printed last.
# VLLM_REQUIRE_GPU=1 makes every GPU test fail (never skip) if no GPU is usable.

set -uo pipefail
G=${G:-.gpu}
LOG=${LOG:-/tmp/gpu-round}
mkdir -p "$LOG"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export LD_LIBRARY_PATH=$CUDA_HOME/lib64:${LD_LIBRARY_PATH:-}
export VLLM_REQUIRE_GPU=1
export VLLM_RS_KERNEL_CACHE=${VLLM_RS_KERNEL_CACHE:-/tmp/vllm-rs-kernel-cache}
# CUBINs compiled on the development machine (`vllm-rs compile-kernels --cache-dir .gpu/kc`)
# save the round NVRTC's minute and a half; an entry of another source is never used.
if [ -d "$G/kc" ]; then mkdir -p "$VLLM_RS_KERNEL_CACHE" && cp "$G"/kc/*.cubin "$VLLM_RS_KERNEL_CACHE"/ 2>/dev/null; fi
export RUST_LOG=${RUST_LOG:-info}
# NVLink multicast stays off on shared multi-GPU machines; the workers inherit it.
export NCCL_NVLS_ENABLE=0
STAGES=${*:-info kernels kernel-bench model serve parity bench}
# The tensor-parallel sizes the tp-* stages run: 1, 2, 4 and 8 up to the GPUs there are.
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
TP_SIZES=${TP_SIZES:-$(for t in 1 2 4 8; do [ "$t" -le "${GPUS:-1}" ] && echo -n "$t "; done)}
TP_MAX=$(echo "$TP_SIZES" | awk '{print $NF}')
TP_LIST=$(echo "$TP_SIZES" | tr ' ' '\n' | awk '$1 > 1' | paste -sd, -)
SUMMARY=()
BIN=${BIN:-$G/vllm-rs}
MODELS=/tmp/vllm-rs-models

# stage NAME CMD…: runs CMD with output in $LOG/NAME.log, records rc and seconds.
stage() {
    local name=$1
    shift
    local t0 t1 rc
    t0=$(date +%s.%N)
    # A stage that hangs is killed (rc 124) instead of eating the whole call.
    timeout -k 5 "${STAGE_TIMEOUT:-300}" bash -c '"$@"' _ "$@" >"$LOG/$name.log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    SUMMARY+=("$(printf "%-18s rc=%-3s %6.1fs" "$name" "$rc" "$(awk "BEGIN{print $t1 - $t0}")")")
    echo "== $name (rc=$rc)"
    grep -a -E "SKIPPED|test result|STEP|NCCL-CHECK|MODEL-CHECK|SAMPLER-CHECK|PARITY|BENCH|MATCH|DIFFER|differs|build\+save|error|Error|^\|" \
        "$LOG/$name.log" | grep -v "^\s*$" | head -40
    grep -a -A4 "panicked" "$LOG/$name.log" | head -30
    return 0
}

# The SmolLM2 GGUF, joined from its parts on first use; the gguf package for transformers.
smollm2_setup() {
    local f=$G/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -f "$f" ] || cat "$G"/smollm2.part* >"$f"
    python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-deps "$G"/wheels/gguf-*.whl
    echo "$f"
}

make_model() { # preset dir
    [ -d "$2" ] || "$BIN" make-tiny-model --preset "$1" --out "$2" >/dev/null
}

# bench_run SECONDS ERR ARGS…: `$BIN ARGS…` under a timeout ($BENCH_TIMEOUT, else SECONDS),
# its report as indented BENCH lines, its stderr in $LOG/ERR, then its exit status.
bench_run() {
    local secs=${BENCH_TIMEOUT:-$1} err=$2
    shift 2
    timeout -k 5 "$secs" "$BIN" "$@" 2>"$LOG/$err" | sed 's/^/BENCH   /'
    echo "BENCH   (rc=${PIPESTATUS[0]})"
}

# Greedy text on cuda vs cpu through the real processes (generate).
served_check() {
    local preset=$1 tokens=$2
    local dir=$MODELS/$preset
    make_model "$preset" "$dir"
    local gpu cpu
    gpu=$("$BIN" generate --model "$dir" --device cuda --prompt "Hello world, this is" \
        --max-tokens "$tokens" --temperature 0 --ignore-eos 2>"$LOG/gen-$preset-cuda.err")
    echo "cuda rc=$? log: $(grep -E 'KV cache size|CUDA backend ready|compiled' "$LOG/gen-$preset-cuda.err" | tr '\n' ' ' | cut -c1-400)"
    cpu=$("$BIN" generate --model "$dir" --device cpu --prompt "Hello world, this is" \
        --max-tokens "$tokens" --temperature 0 --ignore-eos 2>/dev/null)
    if [ "$gpu" == "$cpu" ] && [ -n "$gpu" ]; then
        echo "MATCH $preset greedy $tokens tokens cuda == cpu: $(echo "$gpu" | head -c 80)"
    else
        echo "DIFFER $preset greedy $tokens tokens"
        echo "  cuda: $(echo "$gpu" | head -c 200)"
        echo "  cpu:  $(echo "$cpu" | head -c 200)"
    fi
}

serve_stage() {
    served_check tiny-qwen3 32
    served_check tiny-llama 32
    served_check qwen3-0.6b 16
    # --device auto picks the GPU here.
    "$BIN" generate --model "$MODELS/tiny-qwen3" --prompt "Hi" --max-tokens 4 --temperature 0 \
        2>&1 >/dev/null | grep -E "cuda:0|device" | head -3
    # Without CUDA_HOME and LD_LIBRARY_PATH the libraries are found only if the system
    # loader knows them; otherwise the run ends with a one-line error naming the library.
    if env -u LD_LIBRARY_PATH CUDA_HOME=/nonexistent "$BIN" generate --model "$MODELS/tiny-qwen3" \
        --device cuda --prompt "Hi" --max-tokens 2 >/dev/null 2>"$LOG/nolib.err"; then
        echo "without CUDA_HOME/LD_LIBRARY_PATH: ran (the system loader path has the libraries)"
    else
        echo "without CUDA_HOME/LD_LIBRARY_PATH: $(grep '^error' "$LOG/nolib.err" | head -1)"
    fi
}

# Waits until the server on `port` answers /health, it exits, or `tenths` of a second pass.
wait_health() {
    local port=$1 pid=$2 tenths=${3:-1200}
    for _ in $(seq 1 "$tenths"); do
        curl -sf "localhost:$port/health" >/dev/null 2>&1 && return 0
        kill -0 "$pid" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# Seconds from `serve` to the first /health 200.
time_to_health() {
    local dir=$1 port=$2
    local t0 t1
    t0=$(date +%s.%N)
    "$BIN" serve --model "$dir" --port "$port" --device cuda >"$LOG/serve-$port.log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 1200); do
        if curl -sf "localhost:$port/health" >/dev/null 2>&1; then
            t1=$(date +%s.%N)
            awk "BEGIN{printf \"%.2f\", $t1 - $t0}"
            kill "$pid" 2>/dev/null
            wait "$pid" 2>/dev/null
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || { echo "exited ($(grep '^error' "$LOG/serve-$port.log" | head -1))"; return 1; }
        sleep 0.1
    done
    kill "$pid" 2>/dev/null
    echo "timeout"
}

# 256 requests of the nanovllm-256 set, all at once, over HTTP.
throughput() {
    local dir=$1 port=$2
    "$BIN" serve --model "$dir" --port "$port" --device cuda >"$LOG/serve-bench.log" 2>&1 &
    local pid=$!
    wait_health "$port" "$pid"
    python3 - "$port" "$G/nanovllm-256.jsonl" "${BENCH_DEADLINE:-200}" <<'EOF'
import json, sys, time, threading, urllib.request
port, path, deadline = sys.argv[1], sys.argv[2], float(sys.argv[3])
rows = [json.loads(l) for l in open(path)]
res = [None] * len(rows)
def one(i, r):
    body = json.dumps({"prompt": r["prompt_token_ids"], "max_tokens": r["max_tokens"],
                       "temperature": 0.6, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://localhost:{port}/v1/completions", body,
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as f:
        res[i] = json.load(f)["usage"]["completion_tokens"]
t0 = time.time()
ts = [threading.Thread(target=one, args=(i, r), daemon=True) for i, r in enumerate(rows)]
[t.start() for t in ts]
for t in ts:
    t.join(max(0.0, deadline - (time.time() - t0)))
dt = time.time() - t0
done = sum(1 for x in res if x)
out = sum(x or 0 for x in res)
note = "" if done == len(rows) else f" (STOPPED at the {deadline:.0f}s deadline)"
print(f"BENCH throughput nanovllm-256 T=0.6 ignore_eos: {dt:.2f}s, {done}/{len(rows)} requests, "
      f"{out} output tokens, {out/dt:.0f} output tok/s{note}", flush=True)
EOF
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
}

bench_stage() {
    local m=$MODELS/qwen3-0.6b
    make_model qwen3-0.6b "$m"
    rm -rf "$VLLM_RS_KERNEL_CACHE"
    echo "BENCH serve→/health 200, cold kernel cache: $(time_to_health "$m" 8101)s"
    echo "BENCH serve→/health 200, warm kernel cache: $(time_to_health "$m" 8102)s"
    offline_bench "$m"
    # The same workload over HTTP (serve + 256 concurrent clients), when asked.
    if [ "${BENCH_HTTP:-0}" = 1 ]; then throughput "$m" 8103; fi
}

# vllm-rs bench latency and bench throughput (in-process, no HTTP).
offline_bench() {
    local m=$1 att
    make_model qwen3-0.6b "$m"
    for att in ${ATTENTION_BACKENDS:-flash cuda-core}; do
        echo "BENCH latency qwen3-0.6b --attention-backend $att (128 prompt, 256 output, batch 1):"
        bench_run 120 "bench-latency-$att.err" bench latency --model "$m" --device cuda \
            --attention-backend "$att" $ENGINE_ARGS --input-len 128 --output-len 256 \
            --batch-size 1 --num-iters-warmup 2 --num-iters 5
        echo "BENCH throughput nanovllm-256 --attention-backend $att (bench throughput, in-process):"
        bench_run 120 "bench-throughput-$att.err" bench throughput --model "$m" --device cuda \
            --attention-backend "$att" $ENGINE_ARGS --dataset "$G/nanovllm-256.jsonl" \
            --temperature 0.6 --ignore-eos
    done
}

# Where a throughput run's time goes: per-step phases, summed by scripts/step_profile.py.
# (Nsight Compute is on the GPU machine but did not attach to the worker processes in
# one try; `kernel-bench` times the kernels instead.)
profile_stage() {
    local m=$MODELS/qwen3-0.6b att=${ATTENTION_BACKENDS%% *}
    att=${att:-flash}
    make_model qwen3-0.6b "$m"
    RUST_LOG=info,vllm_engine_core::step=debug,vllm_worker::step=debug \
        timeout -k 5 "${BENCH_TIMEOUT:-120}" "$BIN" bench throughput --model "$m" --device cuda \
        --attention-backend "$att" $ENGINE_ARGS --dataset "$G/nanovllm-256.jsonl" --temperature 0.6 \
        --ignore-eos 2>"$LOG/profile-steps.err" | sed 's/^/BENCH   /'
    python3 scripts/step_profile.py "$LOG/profile-steps.err" | sed "s/^/STEP /"
}

# Single-request decode latency of the Qwen3-8B shape, with random weights generated at
# load (--load-format dummy: the folder holds only config.json and the tokenizer).
latency_8b() {
    local att
    for att in ${ATTENTION_BACKENDS:-flash}; do
        echo "BENCH latency qwen3-8b --attention-backend $att (128 prompt, 256 output, batch 1):"
        bench_run 120 "latency-8b-$att.err" bench latency --model "$G/models/Qwen3-8B" \
            --load-format dummy --device cuda --attention-backend "$att" $ENGINE_ARGS --input-len 128 \
            --output-len 256 --batch-size 1 --num-iters-warmup 2 --num-iters 5
    done
}

# Issue 11's serving workload: `vllm-rs bench serve`, 1000 random prompts of 512 tokens
# with 128 out, every request at once and then at 16 req/s, against `serve` on the
# Qwen3-0.6B shape.
serve_bench() {
    local m=$MODELS/qwen3-0.6b port=8140 pid rate
    make_model qwen3-0.6b "$m"
    "$BIN" serve --model "$m" --device cuda --port $port $ENGINE_ARGS >"$LOG/serve-bench-serve.log" 2>&1 &
    pid=$!
    wait_health $port $pid
    for rate in inf 16; do
        echo "BENCH serve 1000 x 512/128 --request-rate $rate $ENGINE_ARGS:"
        bench_run 150 "serve-bench-$rate.err" bench serve --port $port --model "$m" \
            --dataset-name random --random-input-len 512 --random-output-len 128 \
            --num-prompts 1000 --request-rate $rate --ignore-eos --seed 0 --disable-tqdm
    done
    kill $pid 2>/dev/null
    wait $pid 2>/dev/null
}

# The Llama-3.1-8B shape at saturation: nanovllm-256 through bench throughput, dummy
# weights drawn on the GPU, Llama 3's tokenizer from the 70B folder.
llama_8b() {
    echo "BENCH throughput nanovllm-256 llama-3.1-8b $ENGINE_ARGS:"
    bench_run 150 "llama-8b.err" bench throughput --model "$G/models/Llama-3.1-8B" \
        --tokenizer "$G/models/Llama-3.1-70B" --load-format dummy --device cuda $ENGINE_ARGS \
        --dataset "$G/nanovllm-256.jsonl" --temperature 0.6 --ignore-eos
}

# Tensor parallelism: greedy text at TP=2 equals TP=1 (random Qwen3 models, real processes).
tp_serve() {
    local preset tokens dir one two
    for preset in tiny-qwen3 qwen3-0.6b; do
        dir=$MODELS/$preset
        make_model "$preset" "$dir"
        one=$("$BIN" generate --model "$dir" --device cuda -t 1 --prompt "Hello world, this is" \
            --max-tokens 32 --temperature 0 --ignore-eos 2>"$LOG/tp1-$preset.err")
        two=$("$BIN" generate --model "$dir" --device cuda -t 2 --prompt "Hello world, this is" \
            --max-tokens 32 --temperature 0 --ignore-eos 2>"$LOG/tp2-$preset.err")
        if [ "$one" == "$two" ] && [ -n "$one" ]; then
            echo "MATCH $preset greedy 32 tokens TP=2 == TP=1"
        else
            echo "DIFFER $preset TP=2 vs TP=1"
            echo "  tp1: $(echo "$one" | head -c 200)"
            echo "  tp2: $(echo "$two" | head -c 200)"
            grep -a -E "ERROR|error" "$LOG/tp2-$preset.err" | head -5
        fi
    done
    # More ranks than GPUs: startup fails with the rank's own error, and nothing is left.
    local gpus
    gpus=$(nvidia-smi -L | wc -l)
    if timeout 120 "$BIN" generate --model "$MODELS/tiny-qwen3" --device cuda -t $((gpus * 2)) \
        --prompt "Hi" --max-tokens 2 >/dev/null 2>"$LOG/tp-too-many.err"; then
        echo "DIFFER TP=$((gpus * 2)) on $gpus GPUs started"
    else
        echo "TP=$((gpus * 2)) on $gpus GPUs: $(grep -a -m1 -o 'worker rank [0-9]*:.*' "$LOG/tp-too-many.err" | cut -c1-200)"
    fi
    sleep 1
    echo "processes left: $(pgrep -c -f "$BIN" || true)"
}

# Batch-1 decode of the Qwen3-8B shape at each of $TP_SIZES (dummy weights drawn on the
# GPU); the largest again with NCCL alone instead of the custom all-reduce.
tp_latency() {
    local run tp extra
    for run in $TP_SIZES "$TP_MAX --disable-custom-all-reduce"; do
        read -r tp extra <<<"$run"
        echo "BENCH latency qwen3-8b TP=$tp ${extra:-} (128 prompt, 256 output, batch 1):"
        # shellcheck disable=SC2086
        bench_run 150 "tp-latency-$tp${extra:+-nccl}.err" bench latency --model "$G/models/Qwen3-8B" \
            --load-format dummy --device cuda -t "$tp" $extra --input-len 128 --output-len 256 \
            --batch-size 1 --num-iters-warmup 2 --num-iters 5 ${ENGINE_ARGS:-}
    done
}

tp_throughput() {
    local m=$MODELS/qwen3-0.6b tp
    make_model qwen3-0.6b "$m"
    for tp in $TP_SIZES; do
        echo "BENCH throughput nanovllm-256 qwen3-0.6b TP=$tp (bench throughput, in-process):"
        bench_run 150 "tp-throughput-$tp.err" bench throughput --model "$m" --device cuda \
            -t "$tp" --dataset "$G/nanovllm-256.jsonl" --temperature 0.6 --ignore-eos ${ENGINE_ARGS:-}
    done
}

# The Llama-3.1-70B shape at TP=$TP_MAX with dummy weights: start-up, one API answer, TPOT.
tp_70b() {
    local m=$G/models/Llama-3.1-70B port=8170 t0 pid
    t0=$(date +%s.%N)
    "$BIN" serve --model "$m" --load-format dummy --device cuda -t "$TP_MAX" --port $port \
        --max-model-len 8192 >"$LOG/serve-70b.log" 2>&1 &
    pid=$!
    if wait_health $port $pid 1800; then
        echo "BENCH 70b TP=$TP_MAX serve -> /health 200: $(awk "BEGIN{print $(date +%s.%N) - $t0}")s"
    else
        echo "BENCH 70b TP=$TP_MAX serve did not answer /health:"
        tail -n 3 "$LOG/serve-70b.log" | sed 's/^/BENCH   /'
    fi
    grep -a -E "loaded|KV cache|ERROR" "$LOG/serve-70b.log" | head -6
    echo "BENCH 70b completion: $(curl -s "localhost:$port/v1/completions" -H 'content-type: application/json' \
        -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}' | head -c 300)"
    kill $pid 2>/dev/null
    wait $pid 2>/dev/null
    echo "BENCH latency llama-3.1-70b TP=$TP_MAX (128 prompt, 128 output, batch 1):"
    bench_run 200 "latency-70b.err" bench latency --model "$m" --load-format dummy \
        --device cuda -t "$TP_MAX" --input-len 128 --output-len 128 --batch-size 1 \
        --num-iters-warmup 1 --num-iters 3 --max-model-len 8192 ${ENGINE_ARGS:-}
}

# One TP=$TP_MAX rank's own step, without collectives: bench latency at TP=1 of models of a
# rank's shapes (the heads and MLP over TP_MAX, the whole vocabulary), Qwen3-8B and the
# Llama-3.1-70B shape. TPOT at TP_MAX less this is what the collectives cost.
tp_rank_latency() {
    local name src dst
    for name in Qwen3-8B Llama-3.1-70B; do
        src=$G/models/$name dst=$MODELS/$name-rank$TP_MAX
        mkdir -p "$dst" && find "$src" -maxdepth 1 -type f ! -name config.json -exec cp {} "$dst"/ \;
        python3 - "$src/config.json" "$dst/config.json" "$TP_MAX" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
n = int(sys.argv[3])
c["head_dim"] = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
    c[k] = max(1, c[k] // n)
json.dump(c, open(sys.argv[2], "w"))
PY
        echo "BENCH latency $name, one TP=$TP_MAX rank's shapes at TP=1 (128 prompt, 128 output, batch 1):"
        bench_run 150 "tp-rank-$name.err" bench latency --model "$dst" --load-format dummy \
            --device cuda -t 1 --input-len 128 --output-len 128 --batch-size 1 --num-iters-warmup 1 \
            --num-iters 3 --max-model-len 8192 ${ENGINE_ARGS:-}
    done
}

# Decode-step time at batch 256 (prompts of 100-1,023 tokens) in the runner, then ncu's
# per-kernel GPU time over 4 of those steps (graph nodes measured alone, caches and clocks
# as they run; the test brackets its decode steps with cuProfilerStart/Stop).
batch_bench() {
    local t=backend::cuda::tests::graphs::decode_batch_bench
    "$G/worker_tests" $t --ignored --nocapture
    VLLM_BENCH_STEPS=4 timeout -k 5 "${BENCH_TIMEOUT:-240}" "$CUDA_HOME/bin/ncu" --profile-from-start off \
        --graph-profiling node --metrics gpu__time_duration.sum --cache-control none \
        --clock-control none --csv "$G/worker_tests" $t --ignored --nocapture >"$LOG/ncu.csv" 2>&1
    echo "BENCH ncu (rc=$?), 4 decode steps:"
    python3 scripts/ncu_sum.py "$LOG/ncu.csv" | head -30 | sed 's/^/BENCH /'
}

# One prefill step of $VLLM_BENCH_BATCH prompts (default 14: about 7,900 tokens, the size
# of nanovllm-256's prefill steps), timed, then ncu per kernel of that step alone.
prefill_bench() {
    local t=backend::cuda::tests::graphs::decode_batch_bench
    export VLLM_BENCH_BATCH=${VLLM_BENCH_BATCH:-14} VLLM_BENCH_STEPS=2
    "$G/worker_tests" $t --ignored --nocapture
    VLLM_PROFILE_PREFILL=1 timeout -k 5 "${BENCH_TIMEOUT:-240}" "$CUDA_HOME/bin/ncu" --profile-from-start off \
        --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv \
        "$G/worker_tests" $t --ignored --nocapture >"$LOG/ncu-prefill.csv" 2>&1
    echo "BENCH ncu (rc=$?), the prefill step:"
    python3 scripts/ncu_sum.py "$LOG/ncu-prefill.csv" | head -30 | sed 's/^/BENCH /'
}

# The sampling benchmarks (cuda_bench, 256 rows of Qwen's vocabulary, the whole call),
# then each case under ncu: GPU time per kernel over every call of the case; then the top
# kernel's stall samples by SASS instruction.
sampling_bench() {
    local t=sampling_kernels case
    "$G/cuda_bench" $t --ignored --nocapture
    for case in "greedy" "temperature 0.6" "temperature 0.6 min-p 0.05" "t 0.6 top-k 20 top-p 0.95" \
        "t 0.6 top-p 0.9 (peaked)" "t 0.6 top-k 20 top-p 0.95 (peaked)" \
        "t 0.6 top-k 20 top-p 0.95 (normal)"; do
        VLLM_BENCH_CASE="$case" timeout -k 5 "${BENCH_TIMEOUT:-120}" "$CUDA_HOME/bin/ncu" \
            --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv \
            "$G/cuda_bench" $t --ignored --nocapture >"$LOG/ncu-sampling.csv" 2>&1
        echo "BENCH ncu (rc=$?) '$case' (every call of the case, both ways of timing it):"
        python3 scripts/ncu_sum.py "$LOG/ncu-sampling.csv" | head -8 | sed 's/^/BENCH /'
    done
    # Where the top kernel's warps wait, by SASS instruction (scripts/ncu_sass.py).
    VLLM_BENCH_CASE="t 0.6 top-k 20 top-p 0.95 (normal)" timeout -k 5 "${BENCH_TIMEOUT:-120}" \
        "$CUDA_HOME/bin/ncu" --set full --import-source no --kernel-name sample_fast_top \
        --launch-skip 3 --launch-count 1 --page source --print-source sass --csv \
        "$G/cuda_bench" $t --ignored --nocapture >"$LOG/ncu-sampling-sass.csv" 2>&1
    python3 scripts/ncu_sass.py "$LOG/ncu-sampling-sass.csv" 500 8
}

# TPOT of decode batches of long sequences (split decode grids), Qwen3-0.6B and Qwen3-8B
# shapes; with $BASE_BIN set, that build alternates with $BIN on every shape.
long_context() {
    local m=$MODELS/qwen3-0.6b shape model bs il bins b tpot line
    make_model qwen3-0.6b "$m"
    bins="$BIN${BASE_BIN:+ $BASE_BIN $BIN $BASE_BIN}"
    for shape in "$m 8 2000" "$m 16 1500" "$m 32 1500" "$m 64 1000" "$G/models/Qwen3-8B 8 2000" \
        "$G/models/Qwen3-8B 4 1300"; do
        read -r model bs il <<<"$shape"
        line="BENCH long-context $(basename "$model") batch $bs x $il tokens, TPOT ms:"
        for b in $bins; do
            tpot=$(timeout -k 5 "${BENCH_TIMEOUT:-120}" "$b" bench latency --model "$model" \
                --load-format dummy --device cuda --attention-backend flash $ENGINE_ARGS \
                --input-len "$il" --output-len 128 --batch-size "$bs" --num-iters-warmup 1 \
                --num-iters 2 2>>"$LOG/long-context.err" | awk '/Mean TPOT/ {print $3}')
            line="$line $(basename "$b")=${tpot:-failed}"
        done
        echo "$line"
    done
}

# compute-sanitizer over the kernel tests, each run failing on its first report: memcheck
# (out-of-bounds and misaligned accesses) and initcheck (reads of unwritten global memory)
# on every test, racecheck (shared-memory hazards between threads) on attention and the
# small kernels. Racecheck over attention alone takes about 4 minutes on an H100.
sanitize_stage() {
    local cs=$CUDA_HOME/bin/compute-sanitizer run tool filter rc fail=0 log
    for run in memcheck initcheck "racecheck attention" "racecheck small_kernels"; do
        read -r tool filter <<<"$run"
        log="$LOG/sanitize-$tool${filter:+-$filter}.log"
        # shellcheck disable=SC2086
        "$cs" --tool "$tool" --print-limit 20 --error-exitcode 9 "$G/cuda_kernels" --ignored \
            --test-threads=1 $filter >"$log" 2>&1
        rc=$?
        echo "BENCH sanitize $tool ${filter:-every test}: rc=$rc," \
            "$(grep -a -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1 | sed 's/=* *//')"
        [ "$rc" -eq 0 ] || fail=1
    done
    return $fail
}

ENGINE_ARGS=${ENGINE_ARGS:-}
export G LOG BIN MODELS ENGINE_ARGS TP_SIZES TP_MAX
export -f bench_run long_context make_model served_check serve_stage wait_health time_to_health throughput bench_stage offline_bench profile_stage batch_bench prefill_bench sampling_bench latency_8b serve_bench llama_8b \
    tp_serve tp_latency tp_throughput tp_70b tp_rank_latency sanitize_stage

for s in $STAGES; do
    case $s in
    info) stage info bash -c "nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; ls $CUDA_HOME/lib64 | grep -E 'libnvrtc.so|libcublas.so' | head; \
        { cc -O2 -pthread -o /tmp/host_noise scripts/host_noise.c && /tmp/host_noise 2 6 | sed 's/^/BENCH   /'; } || echo 'host noise: not measured (no C compiler)'" ;;
    kernels) stage kernels bash -c "$G/cuda_nvrtc --ignored && $G/cuda_kernels --ignored --test-threads=1 --nocapture" ;;
    sanitize) stage sanitize sanitize_stage ;;
    model) stage model "$G/worker_tests" backend::cuda --ignored --skip hf_parity_dump --skip decode_latency_bench --skip decode_batch_bench --test-threads=1 --nocapture ;;
    serve) stage serve serve_stage ;;
    serve-quick) stage serve-quick served_check qwen3-0.6b 16 ;;
    parity) stage parity python3 scripts/hf_parity.py --configs "$G/models" --test-bin "$G/worker_tests" --work /tmp/vllm-rs-parity --out "$LOG/parity.md" ;;
    parity32) stage parity32 python3 scripts/hf_parity.py --dtype float32 --configs "$G/models" --test-bin "$G/worker_tests" --work /tmp/vllm-rs-parity32 --out "$LOG/parity32.md" ;;
    bench) stage bench bench_stage ;;
    offline-bench) stage offline-bench offline_bench "$MODELS/qwen3-0.6b" ;;
    profile) stage profile profile_stage ;;
    batch-bench) stage batch-bench batch_bench ;;
    prefill-bench) stage prefill-bench prefill_bench ;;
    sampling-bench) stage sampling-bench sampling_bench ;;
    kernel-bench) stage kernel-bench "$G/cuda_bench" --ignored --nocapture ;;
    tp-gemv) stage tp-gemv "$G/cuda_bench" tp_rank_gemvs --ignored --nocapture ;;
    gemm-bench) stage gemm-bench "$G/cuda_bench" decode_gemms --ignored --nocapture ;;
    gemm-candidates) stage gemm-candidates "$G/cuda_bench" gemm_candidates --ignored --nocapture ;;
    decode-late) stage decode-late "$G/cuda_bench" decode_attention_late --ignored --nocapture ;;
    decode-mid) stage decode-mid "$G/cuda_bench" decode_attention_mid --ignored --nocapture ;;
    decode-q-split) stage decode-q-split "$G/cuda_bench" decode_attention_q_split --ignored --nocapture ;;
    kv-read-probe) stage kv-read-probe bash -c "$CUDA_HOME/bin/nvcc -O3 -std=c++20 \
        -gencode=arch=compute_90a,code=sm_90a -o /tmp/kv_read_probe scripts/kv_read_probe.cu \
        && /tmp/kv_read_probe" ;;
    long-context) stage long-context long_context ;;
    gemv) stage gemv bash -c "$G/cuda_kernels --ignored --test-threads=1 gemv linear && $G/cuda_bench thin_gemms --ignored --nocapture" ;;
    graphs) stage graphs "$G/worker_tests" backend::cuda::tests::graphs::decode_latency_bench --ignored --nocapture ;;
    latency-8b) stage latency-8b latency_8b ;;
    serve-bench) stage serve-bench serve_bench ;;
    llama-8b) stage llama-8b llama_8b ;;
    async-check)
        make_model qwen3-0.6b "$MODELS/qwen3-0.6b"
        stage async-check python3 scripts/async_check.py --bin "$BIN" --model "$MODELS/qwen3-0.6b" ;;
    tp-nccl) stage tp-nccl bash -c "VLLM_REQUIRE_GPUS=1 $G/worker_tests --ignored --test-threads=1 --nocapture nccl_ custom_all_reduce_ dummy_weights_drawn_on_the_gpu; python3 scripts/allreduce_torch.py" ;;
    tp-serve) stage tp-serve tp_serve ;;
    tp-latency) stage tp-latency tp_latency ;;
    tp-throughput) stage tp-throughput tp_throughput ;;
    tp-70b) stage tp-70b tp_70b ;;
    tp-rank-latency) stage tp-rank-latency tp_rank_latency ;;
    tp-parity) stage tp-parity python3 scripts/tp_parity.py --tp "${TP_LIST:-2}" --bin "$BIN" --config "$G/models/Qwen3-8B" --work /dev/shm/vllm-rs-tp ;;
    tp-parity-0.6b) stage tp-parity-0.6b python3 scripts/tp_parity.py --tp "${TP_LIST:-2}" --bin "$BIN" --config "$G/models/Qwen3-0.6B" --tokenizer "$G/models/Qwen3-8B" --work /dev/shm/vllm-rs-tp06 --also-with=--disable-custom-all-reduce ;;
    tp-parity32-0.6b) stage tp-parity32-0.6b python3 scripts/tp_parity.py --tp "${TP_LIST:-2}" --dtype float32 --bin "$BIN" --config "$G/models/Qwen3-0.6B" --tokenizer "$G/models/Qwen3-8B" --work /dev/shm/vllm-rs-tp06-32 --also-with=--disable-custom-all-reduce ;;
    tp-parity32) stage tp-parity32 python3 scripts/tp_parity.py --tp "${TP_LIST:-2}" --dtype float32 --bin "$BIN" --config "$G/models/Qwen3-8B" --work /dev/shm/vllm-rs-tp32 ;;
    soak)
        make_model qwen3-0.6b "$MODELS/qwen3-0.6b"
        stage soak bash scripts/soak.sh --bin "$BIN" --device cuda --model "$MODELS/qwen3-0.6b" \
            --seconds "${SOAK_SECONDS:-480}" --clients 64 ;;
    gguf-parity) stage gguf-parity python3 scripts/gguf_parity.py --bin "$BIN" --gguf "$(smollm2_setup)" ;;
    *) echo "unknown stage $s" ;;
    esac
done

[ -n "${OUT:-}" ] && tar czf "$OUT/logs.tgz" -C "$LOG" . 2>/dev/null
echo
echo "== GPU round summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
printf '%s\n' "${SUMMARY[@]}"
