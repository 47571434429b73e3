#!/usr/bin/env bash
# Soak test, localhost only and bounded in time: starts `vllm-rs serve`, runs
# scripts/soak.py against it (saturating random load, streaming and not, random
# cancellations), then stops the server and checks that no process is left.
#
#   scripts/soak.sh [--bin target/release/vllm-rs] [--model DIR] [--device cpu|cuda]
#                   [--seconds 600] [--clients 32] [-- extra serve flags]
#
# Defaults: the release binary, a fresh tiny random model, the CPU, 10 minutes. The last
# lines are a table of the checks; the exit code is 0 only if all pass.
# On the CPU the KV pool is 0.1 GiB (--cpu-kv-cache-space): its pages are touched only when
# a block is first used, and a small pool is cycled through during warm-up, so the RSS
# check sees growth after warm-up (a leak), not first touches of a 2 GiB pool.
# Warm-up is the first 10% of the run (soak.py --warmup): at the CPU's ~75 requests/s that
# is thousands of requests of every shape, so the binary's code is paged in and the heap has
# seen peak concurrency. After it, soak.py compares the median RSS of the first and the last
# quarter of its samples rather than each sample with the first: glibc keeps freed memory
# for a while after a burst, so single samples swing by 10-20% with a flat live heap, while
# a leak moves the medians (soak.py's docstring has the numbers).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release/vllm-rs
MODEL=
DEVICE=cpu
SECONDS_=600
CLIENTS=32
EXTRA=()
while [ $# -gt 0 ]; do
    case $1 in
    --bin) BIN=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --seconds) SECONDS_=$2; shift 2 ;;
    --clients) CLIENTS=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
    esac
done
WORK=$(mktemp -d /tmp/vllm-rs-soak.XXXXXX)
if [ -z "$MODEL" ]; then
    MODEL=$WORK/tiny
    "$BIN" make-tiny-model --out "$MODEL" >/dev/null
fi
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
[ "$DEVICE" = cpu ] && EXTRA=(--cpu-kv-cache-space 0.1 "${EXTRA[@]}")
RUST_LOG=warn "$BIN" serve --model "$MODEL" --device "$DEVICE" --port "$PORT" \
    --served-model-name soak "${EXTRA[@]}" >"$WORK/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "server exited:"; tail -20 "$WORK/serve.log"; exit 1; }
    sleep 0.2
done
# The server's process tree: the frontend, the engine-core, the workers.
tree() {
    local pids=$1 next=$1
    while [ -n "$next" ]; do
        next=$(for p in $next; do awk -v p="$p" '$4 == p {print $1}' /proc/[0-9]*/stat 2>/dev/null; done | tr '\n' ' ')
        pids="$pids $next"
    done
    echo "$pids" | tr -s ' ' '\n' | grep -v '^$' | sort -u | tr '\n' ',' | sed 's/,$//'
}
PIDS=$(tree $SERVER)
echo "soak: server pid $SERVER, process tree $PIDS, port $PORT, $SECONDS_ s, $CLIENTS clients"
set +e
python3 scripts/soak.py --port "$PORT" --seconds "$SECONDS_" --clients "$CLIENTS" --pids "$PIDS"
RC=$?
set -e
kill -TERM $SERVER
for _ in $(seq 150); do kill -0 $SERVER 2>/dev/null || break; sleep 0.2; done
LEFT=$(for p in ${PIDS//,/ }; do if [ -e /proc/$p ]; then echo $p; fi; done | tr '\n' ' ')
if [ -n "$LEFT" ]; then
    echo "| processes left after SIGTERM | FAIL | $LEFT |"
    RC=1
else
    echo "| processes left after SIGTERM | PASS | none of $PIDS |"
fi
exit $RC
