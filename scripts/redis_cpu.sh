#!/usr/bin/env bash
# What one script call costs Redis, side by side in one run: burstgate's script against a common
# hash token bucket (scripts/hash_bucket.lua), on a private redis-server.
#
# Each round resets Redis's statistics, drives the hash bucket with redis-benchmark (16 clients,
# 16 calls in flight each, 10,000 keys, every call admitted), reads `usec_per_call` for EVALSHA
# from INFO commandstats, then drives burstgate's script the same way with `loadgen --pipeline 16
# --concurrency 16` (redis-benchmark cannot send its packed argument), which reads the same
# figure. It prints each round, then the medians and the median of the per-round ratios.
#
#     usage: scripts/redis_cpu.sh [ROUNDS]      (5 by default)
#
# Needs redis-server and redis-benchmark on the PATH (Debian: apt-get install redis-server) and
# builds loadgen in release mode. The redis-server it starts is stopped by pid when it exits.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=${1:-5}

for tool in redis-server redis-cli redis-benchmark; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "redis_cpu.sh: $tool not found; install it with: apt-get install redis-server" >&2
        exit 2
    fi
done

cargo build -q --release -p burstgate-tools --bin loadgen
loadgen=${CARGO_TARGET_DIR:-target}/release/loadgen

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no >/dev/null 2>&1 &
redis_pid=$!
trap 'kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true' EXIT
cli() { redis-cli -p "$port" "$@"; }
for _ in $(seq 50); do
    cli PING >/dev/null 2>&1 && break
    sleep 0.1
done

sha=$(cli SCRIPT LOAD "$(cat scripts/hash_bucket.lua)")
now=$(date +%s%3N)
results=$(mktemp)
trap 'rm -f "$results"; kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true' EXIT

for round in $(seq "$rounds"); do
    cli CONFIG RESETSTAT >/dev/null
    # 2^32 - 1 tokens per second, so that every call admits, as loadgen's do.
    rate=$(redis-benchmark -p "$port" -c 16 -n 400000 -r 10000 -P 16 -q \
        EVALSHA "$sha" 1 hash-bucket:__rand_int__ 4294967.295 4294967295 "$now" 1 |
        tr '\r' '\n' | grep -o '[0-9.]* requests per second' | tail -1 | cut -d' ' -f1)
    usec=$(cli INFO commandstats | tr -d '\r' | grep '^cmdstat_evalsha:' |
        grep -o 'usec_per_call=[0-9.]*' | cut -d= -f2)
    echo "round $round  hash bucket  ${rate}/s  usec_per_call=${usec}"
    echo "hash $rate $usec" >>"$results"
    line=$("$loadgen" --url "redis://127.0.0.1:$port/" --concurrency 16 --pipeline 16 --seconds 2)
    rate=$(grep -o 'rate=[0-9]*' <<<"$line" | cut -d= -f2)
    usec=$(grep -o 'usec_per_call=[0-9.]*' <<<"$line" | cut -d= -f2)
    echo "round $round  burstgate    ${rate}/s  usec_per_call=${usec}"
    echo "burstgate $rate $usec" >>"$results"
done

python3 - "$results" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
hash_rows = [(float(r), float(u)) for name, r, u in rows if name == "hash"]
ours = [(float(r), float(u)) for name, r, u in rows if name == "burstgate"]
for name, rs in (("hash bucket", hash_rows), ("burstgate", ours)):
    print(f"median {name:<11}  {statistics.median(r for r, _ in rs):.0f}/s  "
          f"usec_per_call={statistics.median(u for _, u in rs):.2f}")
ratios = [o[1] / h[1] for h, o in zip(hash_rows, ours)]
print(f"burstgate / hash bucket, usec_per_call: median {statistics.median(ratios):.3f} "
      f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")
PY
