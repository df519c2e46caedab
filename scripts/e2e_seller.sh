#!/usr/bin/env bash
# End-to-end check of the seller-API client side: several client processes share one Redis
# bucket and call an independent HTTP server that enforces a token bucket of its own.
#
# It starts a private redis-server and scripts/token_bucket_server.py on free loopback ports, runs
# CLIENTS processes of `tools/src/seller_client.rs` at once (TASKS concurrent tasks each, one
# account, for RUN_SECONDS), and reports what they sent, the server's 429 answers, and the budget
# used: the requests the server admitted over the most it could have admitted,
#
#     burst + rate x elapsed,
#
# where elapsed runs from the first request the server received to the moment the last client
# stopped sending. It exits non-zero unless the server answered at most MAX_429 429s (default
# none) and the budget used is at least MIN_BUDGET percent. Everything it starts is stopped by
# pid when it exits.
#
# With FOREIGN above 0, a consumer inside the server spends the same account's bucket at that
# fraction of its rate (another integration with the same token), and the server reports
# X-Ratelimit-Remaining on every answer (REPORT_REMAINING=1, the default then). The budget is
# then what the foreign consumer left, burst + rate x elapsed less its admitted takes in that
# time. FOLLOW=0 makes the clients ignore the reports (the middleware's follow_upstream(false)).
#
# Time is scaled: the default limit is the orders group's "1 per minute, burst 10" run 120 times
# faster, 1 per 500 ms, burst 10. The clients spend it with a margin of MARGIN_MS per token
# (burstgate::seller::Group::margin): the server's bucket starts at the first request it
# receives and has no tolerance, so a client at exactly its rate is now and then early.
#
# Settings (environment): CLIENTS=4 TASKS=16 RUN_SECONDS=10 INTERVAL_MS=500 BURST=10 MARGIN_MS=10
# MIN_BUDGET=95, SERVER_BURST (the server's burst, default BURST; BURST is the clients'),
# FOREIGN=0, REPORT_REMAINING, FOLLOW=1, MAX_429=0, CARGO_TARGET_DIR as for cargo,
# PROFILE=debug (or release).
#
# The client side following a server whose tokens someone else spends (about 25 s):
#
#     FOREIGN=0.3 INTERVAL_MS=50 BURST=9 SERVER_BURST=10 MARGIN_MS=5 RUN_SECONDS=8 \
#         MAX_429=2 MIN_BUDGET=80 scripts/e2e_seller.sh
set -euo pipefail

CLIENTS=${CLIENTS:-4}
TASKS=${TASKS:-16}
RUN_SECONDS=${RUN_SECONDS:-10}
INTERVAL_MS=${INTERVAL_MS:-500}
BURST=${BURST:-10}
MARGIN_MS=${MARGIN_MS:-10}
MIN_BUDGET=${MIN_BUDGET:-95}
SERVER_BURST=${SERVER_BURST:-$BURST}
FOREIGN=${FOREIGN:-0}
if [ "$FOREIGN" != 0 ]; then
    REPORT_REMAINING=${REPORT_REMAINING:-1}
else
    REPORT_REMAINING=${REPORT_REMAINING:-0}
fi
FOLLOW=${FOLLOW:-1}
MAX_429=${MAX_429:-0}
PROFILE=${PROFILE:-debug}

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
WORK=$(mktemp -d)
PIDS=()

cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits up to five seconds for a command to succeed.
wait_for() {
    local i
    for i in $(seq 50); do
        if "$@" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.1
    done
    echo "e2e: timed out waiting for: $*" >&2
    return 1
}

build_flags=(-p burstgate-tools --bin seller_client)
if [ "$PROFILE" = release ]; then
    build_flags+=(--release)
fi
(cd "$ROOT" && cargo build -q "${build_flags[@]}")
CLIENT_BIN=$TARGET_DIR/$PROFILE/seller_client

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --daemonize no >"$WORK/redis.log" 2>&1 &
PIDS+=($!)
wait_for redis-cli -p "$REDIS_PORT" ping

HTTP_PORT=$(free_port)
RATE=$(python3 -c "print(1000 / $INTERVAL_MS)")
TOKEN="Bearer e2e-seller-account"
server_flags=()
if [ "$REPORT_REMAINING" = 1 ]; then
    server_flags+=(--report-remaining)
fi
if [ "$FOREIGN" != 0 ]; then
    server_flags+=(--foreign "$FOREIGN" --foreign-account "$TOKEN")
fi
python3 -u "$ROOT/scripts/token_bucket_server.py" "$HTTP_PORT" "$RATE" "$SERVER_BURST" \
    "${server_flags[@]}" >"$WORK/server.log" 2>"$WORK/server.err" &
SERVER_PID=$!
PIDS+=("$SERVER_PID")
wait_for grep -q listening "$WORK/server.log"

echo "e2e: $CLIENTS processes x $TASKS tasks, one Redis bucket (redis-server on port $REDIS_PORT),"
echo "     server scripts/token_bucket_server.py on port $HTTP_PORT: 1 per $INTERVAL_MS ms, burst"
echo "     $SERVER_BURST, reporting what is left: $REPORT_REMAINING, a foreign consumer at $FOREIGN of"
echo "     its rate; clients: burst $BURST, a margin of $MARGIN_MS ms per token, following the"
echo "     reports: $FOLLOW; $RUN_SECONDS s"

client_flags=()
if [ "$FOLLOW" = 0 ]; then
    client_flags+=(--no-follow)
fi

PREFIX="e2e-$(date +%s%N)"
CLIENT_PIDS=()
for i in $(seq "$CLIENTS"); do
    REDIS_URL="redis://127.0.0.1:$REDIS_PORT/" "$CLIENT_BIN" \
        --url "http://127.0.0.1:$HTTP_PORT/api/v1/supplier/orders" \
        --token "$TOKEN" --seconds "$RUN_SECONDS" --tasks "$TASKS" \
        --interval-ms "$INTERVAL_MS" --burst "$BURST" --margin-ms "$MARGIN_MS" \
        --prefix "$PREFIX" "${client_flags[@]}" >"$WORK/client.$i.log" 2>&1 &
    CLIENT_PIDS+=($!)
    PIDS+=($!)
done
failed=0
for pid in "${CLIENT_PIDS[@]}"; do
    wait "$pid" || failed=1
done

kill -TERM "$SERVER_PID"
wait "$SERVER_PID" || true
for i in $(seq "$CLIENTS"); do
    echo "process $i: $(tail -n 1 "$WORK/client.$i.log")"
done
totals=$(grep '^totals:' "$WORK/server.log" || true)
foreign_ms=$(grep '^foreign_ms:' "$WORK/server.log" || true)
echo "server: $totals"
if [ -s "$WORK/server.err" ]; then
    echo "server's 429s ($(wc -l <"$WORK/server.err") lines on its stderr, the first 20):"
    head -n 20 "$WORK/server.err" | sed 's/^/  /'
fi
if [ "$failed" != 0 ] || [ -z "$totals" ]; then
    echo "e2e: a process failed" >&2
    for i in $(seq "$CLIENTS"); do
        sed "s/^/  client $i: /" "$WORK/client.$i.log" >&2
    done
    sed 's/^/  server: /' "$WORK/server.log" >&2
    exit 1
fi

# The sums, and the budget, from the clients' last lines and the server's totals.
python3 - "$SERVER_BURST" "$RATE" "$MIN_BUDGET" "$MAX_429" "$totals" "$foreign_ms" \
    "$WORK"/client.*.log <<'EOF'
import re
import sys

burst, rate, min_budget = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
max_429 = int(sys.argv[4])
totals = dict(re.findall(r"(\w+) (-?\d+)", sys.argv[5]))
foreign_ms = [int(t) for t in sys.argv[6].split()[1:]]
sent = ok = limited = local = errors = 0
stopped = []
for path in sys.argv[7:]:
    text = open(path).read()
    m = re.search(r"^sent: (\d+), ok: (\d+), upstream 429: (\d+)$", text, re.M)
    s = re.search(r"^stopped_ms: (\d+)$", text, re.M)
    l = re.search(r"^local 429: (\d+), errors: (\d+)$", text, re.M)
    if not (m and s and l):
        sys.exit(f"e2e: no summary in {path}:\n{text}")
    sent += int(m[1]); ok += int(m[2]); limited += int(m[3])
    local += int(l[1]); errors += int(l[2])
    stopped.append(int(s[1]))

admitted, rejected = int(totals["admitted"]), int(totals["rejected"])
elapsed = (max(stopped) - int(totals["first_ms"])) / 1000
# What the foreign consumer took while the clients ran is not the clients' to use.
foreign = sum(1 for t in foreign_ms if t <= max(stopped))
possible = burst + rate * elapsed - foreign
budget = 100 * admitted / possible
print(f"clients: sent {sent}, ok {ok}, upstream 429 {limited}, local 429 {local}, errors {errors}")
print(f"server: admitted {admitted}, answered 429 {rejected}, over {elapsed:.3f} s from its first "
      f"request to the last client's stop; at most {possible:.1f} (burst + rate x elapsed"
      f"{f' - {foreign} foreign' if foreign_ms else ''})")
if foreign_ms or int(totals.get("foreign_rejected", 0)):
    print(f"foreign consumer: admitted {foreign} while the clients ran "
          f"({totals['foreign_admitted']} in all), refused {totals['foreign_rejected']}")
span = (int(totals["last_ms"]) - int(totals["first_ms"])) / 1000
in_span = sum(1 for t in foreign_ms if t <= int(totals["last_ms"]))
print(f"(over the span from the server's first request to its last, {span:.3f} s, the budget "
      f"used is {100 * admitted / (burst + rate * span - in_span):.1f}%)")
print(f"total sent: {sent}, upstream 429: {rejected}, budget used: {budget:.1f}%")
ok_run = rejected <= max_429 and limited <= max_429 and errors == 0 and budget >= min_budget
if not ok_run:
    print(f"e2e: FAILED (needs at most {max_429} 429s, no errors, and a budget of at least "
          f"{min_budget:g}%)")
    sys.exit(1)
print("e2e: passed")
EOF
