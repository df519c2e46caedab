#!/usr/bin/env bash
# End-to-end check of processes whose system clocks disagree sharing one contended bucket, with
# every setting of the crate at its default: does each process get its share, and does nginx,
# enforcing the same limit on its own, never refuse one of them?
#
# It starts a private redis-server and nginx on free loopback ports, then one process of
# `tools/src/skew_client.rs` per entry of OFFSETS, all at once (TASKS tasks each, for
# RUN_SECONDS, starting at one agreed time). Each runs under libfaketime with its own system
# clock shifted by its entry (LD_PRELOAD=$LIBFAKETIME FAKETIME=<offset>, a relative offset in
# seconds: `+0.010` is 10 ms ahead), and each sends through `RateLimitMiddleware::new(
# RedisStore::connect(url)?.prefix(..)?)` with one route of RATE per second, burst BURST, and no
# account: every request of every process draws from the route's one key.
#
# nginx answers with `limit_req_zone ... rate=${RATE}r/s` and `limit_req ... burst=$BURST
# nodelay; limit_req_status 429;`, on one zone key for all. The fixed 200 comes from a named
# location the limited one falls through to with `try_files`: a `return 200` in the limited
# location itself would answer in nginx's rewrite phase, before limit_req (preaccess) ever runs,
# and nothing would be limited. nginx's access log (`$msec $status`) gives the 200s, the 429s and
# the times.
#
# Before the run it checks that each process sees its shifted clock: a client prints its clock
# minus Redis's TIME, which must be its offset to within CLOCK_TOLERANCE_US. After the run it
# reports each process's share of the 200s (from the clients' counts, whose sum must be nginx's
# but for requests a process dropped in flight when its time was up), nginx's 429s, and the
# budget used, in percent:
#
#     admitted / (BURST + 1 + RATE x elapsed),
#
# where admitted is nginx's 200s and elapsed runs from the first request nginx logged to the
# last. BURST + 1 is what nginx's `burst=BURST nodelay` admits at once (the burst and the request
# itself); the clients' bucket holds BURST, one less. It exits non-zero unless every process got
# at least MIN_SHARE percent of the 200s, nginx answered at most MAX_429 429s, no client had an
# error, and the budget used is at least MIN_BUDGET percent. Everything it starts is stopped by
# pid when it exits.
#
# The processes start at one time read on their own clocks, so a process ahead starts its offset
# earlier, as it would on a host of its own. Even on one time, which task gets each token as it
# comes due is a race, and the race alone now and then leaves a process under MIN_SHARE: judge
# the shares over several runs (docs/PERFORMANCE.md, "Clocks that disagree", has runs with no
# clock shifted to compare with).
#
# Settings (environment): OFFSETS="+0 +0.010 +0 -0.001" (one process each) TASKS=16
# RUN_SECONDS=20 RATE=20 BURST=9 MIN_SHARE=15 MAX_429=0 MIN_BUDGET=88 CLOCK_TOLERANCE_US=2000,
# CLIENT_BIN (a skew_client binary to run; without it the script builds this tree's, with
# PROFILE=release or debug, into CARGO_TARGET_DIR as for cargo), LIBFAKETIME (default Debian's
# /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1), NGINX (default `nginx` on the PATH, or
# /usr/sbin/nginx).
#
# Needs redis-server, nginx (1.19.5 or later, for -e) and libfaketime: on Debian or Ubuntu,
# `apt-get install redis-server nginx-light libfaketime`.
#
#     scripts/e2e_skew.sh
#     CLIENT_BIN=/path/to/an/older/skew_client scripts/e2e_skew.sh     # another build, same check
set -euo pipefail

read -r -a OFFSET_LIST <<<"${OFFSETS:-+0 +0.010 +0 -0.001}"
TASKS=${TASKS:-16}
RUN_SECONDS=${RUN_SECONDS:-20}
RATE=${RATE:-20}
BURST=${BURST:-9}
MIN_SHARE=${MIN_SHARE:-15}
MAX_429=${MAX_429:-0}
# The route's default margin at 20/s is a tenth of the token period (5 ms): it spends 1/1.1 of
# the rate, about 91% of nginx's budget.
MIN_BUDGET=${MIN_BUDGET:-88}
CLOCK_TOLERANCE_US=${CLOCK_TOLERANCE_US:-2000}
PROFILE=${PROFILE:-release}
LIBFAKETIME=${LIBFAKETIME:-/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1}
NGINX=${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}

missing=()
command -v redis-server >/dev/null || missing+=("redis-server (apt-get install redis-server)")
command -v redis-cli >/dev/null || missing+=("redis-cli (apt-get install redis-tools)")
[ -x "$NGINX" ] || missing+=("nginx (apt-get install nginx-light, or set NGINX)")
[ -f "$LIBFAKETIME" ] || missing+=("libfaketime (apt-get install libfaketime, or set LIBFAKETIME)")
if [ "${#missing[@]}" != 0 ]; then
    printf 'e2e: missing: %s\n' "${missing[@]}" >&2
    exit 2
fi
for offset in "${OFFSET_LIST[@]}"; do
    if ! [[ $offset =~ ^[+-][0-9]+(\.[0-9]+)?$ ]]; then
        echo "e2e: an offset is a signed number of seconds, such as +0.010 or -0.001: $offset" >&2
        exit 2
    fi
done

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

if [ -z "${CLIENT_BIN:-}" ]; then
    build_flags=(-p burstgate-tools --bin skew_client)
    if [ "$PROFILE" = release ]; then
        build_flags+=(--release)
    fi
    (cd "$ROOT" && cargo build -q "${build_flags[@]}")
    CLIENT_BIN=$TARGET_DIR/$PROFILE/skew_client
fi

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --daemonize no >"$WORK/redis.log" 2>&1 &
PIDS+=($!)
wait_for redis-cli -p "$REDIS_PORT" ping

HTTP_PORT=$(free_port)
mkdir "$WORK/nginx-tmp"
cat >"$WORK/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $WORK/nginx.pid;
error_log $WORK/nginx-error.log;
events { worker_connections 1024; }
http {
    client_body_temp_path $WORK/nginx-tmp/body;
    proxy_temp_path $WORK/nginx-tmp/proxy;
    fastcgi_temp_path $WORK/nginx-tmp/fastcgi;
    uwsgi_temp_path $WORK/nginx-tmp/uwsgi;
    scgi_temp_path $WORK/nginx-tmp/scgi;
    log_format skew '\$msec \$status';
    access_log $WORK/access.log skew;
    # One key for every request: the server's name.
    limit_req_zone \$server_name zone=skew:1m rate=${RATE}r/s;
    limit_req_status 429;
    server {
        listen 127.0.0.1:$HTTP_PORT;
        server_name skew;
        location = /limited {
            limit_req zone=skew burst=$BURST nodelay;
            try_files /nothing-here @ok;
        }
        location @ok {
            return 200 "ok\n";
        }
    }
}
EOF
"$NGINX" -e "$WORK/nginx-error.log" -p "$WORK" -c "$WORK/nginx.conf" \
    >"$WORK/nginx.out" 2>&1 &
NGINX_PID=$!
PIDS+=("$NGINX_PID")
wait_for python3 -c "import socket; socket.create_connection(('127.0.0.1', $HTTP_PORT), 1)"

echo "e2e: ${#OFFSET_LIST[@]} processes x $TASKS tasks, clocks shifted ${OFFSET_LIST[*]} s"
echo "     (libfaketime), one Redis bucket of $RATE/s, burst $BURST (redis-server on port"
echo "     $REDIS_PORT), every setting at its default; nginx limit_req on port $HTTP_PORT:"
echo "     rate=${RATE}r/s burst=$BURST nodelay; $RUN_SECONDS s; client $CLIENT_BIN"

PREFIX="e2e-skew-$(date +%s%N)"
# Late enough for every process to start, connect and measure first.
START_AT_MS=$(($(date +%s%3N) + 3000))
CLIENT_PIDS=()
for i in "${!OFFSET_LIST[@]}"; do
    LD_PRELOAD=$LIBFAKETIME FAKETIME=${OFFSET_LIST[$i]} \
        REDIS_URL="redis://127.0.0.1:$REDIS_PORT/" "$CLIENT_BIN" \
        --url "http://127.0.0.1:$HTTP_PORT/limited" --seconds "$RUN_SECONDS" \
        --tasks "$TASKS" --rate "$RATE" --burst "$BURST" --prefix "$PREFIX" \
        --start-at-ms "$START_AT_MS" >"$WORK/client.$i.log" 2>"$WORK/client.$i.err" &
    CLIENT_PIDS+=($!)
    PIDS+=($!)
done

# Each process must see the clock it was given before the run counts for anything.
for i in "${!OFFSET_LIST[@]}"; do
    wait_for grep -q '^clock_offset_us:' "$WORK/client.$i.log" || {
        cat "$WORK/client.$i.err" >&2
        exit 1
    }
    seen=$(sed -n 's/^clock_offset_us: //p' "$WORK/client.$i.log")
    if ! python3 - "${OFFSET_LIST[$i]}" "$seen" "$CLOCK_TOLERANCE_US" <<'EOF'; then
import sys
want = round(float(sys.argv[1]) * 1e6)
seen, tolerance = int(sys.argv[2]), int(sys.argv[3])
print(f"e2e: process {sys.argv[1]} s: its clock minus Redis's is {seen:+} us, "
      f"{'as given' if abs(seen - want) <= tolerance else f'NOT the {want:+} us given'}")
sys.exit(abs(seen - want) > tolerance)
EOF
        echo "e2e: libfaketime did not shift the client's clock ($LIBFAKETIME)" >&2
        exit 1
    fi
done

failed=0
for pid in "${CLIENT_PIDS[@]}"; do
    wait "$pid" || failed=1
done
kill -TERM "$NGINX_PID"
wait "$NGINX_PID" || true

if [ "$failed" != 0 ]; then
    echo "e2e: a process failed" >&2
    for i in "${!OFFSET_LIST[@]}"; do
        sed "s/^/  client $i: /" "$WORK/client.$i.log" "$WORK/client.$i.err" >&2
    done
    exit 1
fi
for i in "${!OFFSET_LIST[@]}"; do
    if [ -s "$WORK/client.$i.err" ]; then
        echo "client $i's stderr (the first 10 lines):"
        head -n 10 "$WORK/client.$i.err" | sed 's/^/  /'
    fi
done

python3 - "$RATE" "$BURST" "$MIN_SHARE" "$MAX_429" "$MIN_BUDGET" "$WORK" \
    "${OFFSET_LIST[@]}" <<'EOF'
import re
import sys

rate, burst = float(sys.argv[1]), float(sys.argv[2])
min_share, max_429, min_budget = float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
work = sys.argv[6]
offsets = sys.argv[7:]

processes = []
for i, offset in enumerate(offsets):
    path = f"{work}/client.{i}.log"
    text = open(path).read()
    m = re.search(r"^sent: (\d+), ok: (\d+), upstream 429: (\d+), local 429: (\d+), "
                  r"errors: (\d+)$", text, re.M)
    c = re.search(r"^clock_offset_us: (-?\d+)$", text, re.M)
    f = re.search(r"^first_send_ms: (\d+)$", text, re.M)
    l = re.search(r"^last_send_ms: (\d+)$", text, re.M)
    if not (m and c and f and l):
        sys.exit(f"e2e: no summary in {path}:\n{text}")
    processes.append((offset, [int(x) for x in m.groups()], int(c[1]), int(f[1]), int(l[1])))

times, statuses = [], []
for line in open(f"{work}/access.log"):
    t, status = line.split()
    times.append(float(t))
    statuses.append(int(status))
if not times:
    sys.exit("e2e: nginx logged no request")
admitted = statuses.count(200)
refused = statuses.count(429)
# 499: a client closed the connection before the answer, a request the deadline cut short.
cut = statuses.count(499)
others = len(statuses) - admitted - refused - cut
elapsed = max(times) - min(times)
possible = burst + 1 + rate * elapsed
budget = 100 * admitted / possible

sent_total = sum(p[1][0] for p in processes)
ok_total = sum(p[1][1] for p in processes)
errors = sum(p[1][4] for p in processes)
shares = []
for i, (offset, (sent, ok, up, local, err), clock_us, first, last) in enumerate(processes):
    share = 100 * ok / ok_total if ok_total else 0.0
    shares.append(share)
    print(f"process {i} (FAKETIME={offset}, clock {clock_us / 1000:+.3f} ms from Redis's): "
          f"sent {sent}, ok {ok} ({share:.1f}%), upstream 429 {up}, local 429 {local}, "
          f"errors {err}; sent from {first} to {last} (its clock, ms)")
print(f"nginx: {len(statuses)} requests, 200: {admitted}, 429: {refused}, 499: {cut}, "
      f"other: {others}, "
      f"from its first request to its last {elapsed:.3f} s; at most {possible:.1f} "
      f"(burst + 1 + rate x elapsed)")
print(f"shares: {', '.join(f'{s:.1f}%' for s in shares)}; 429: {refused}; "
      f"budget used: {budget:.1f}%")
problems = []
# A request in flight when its process's time is up is dropped: nginx may have answered it.
if not ok_total <= admitted <= sent_total:
    problems.append(f"the clients counted {ok_total} 200s of {sent_total} sent, nginx {admitted}")
if min(shares) < min_share:
    problems.append(f"a process got under {min_share:g}% of the 200s")
if refused > max_429:
    problems.append(f"{refused} 429s from nginx (at most {max_429})")
if errors or others:
    problems.append(f"{errors} client errors, {others} other answers")
if budget < min_budget:
    problems.append(f"a budget used under {min_budget:g}%")
if problems:
    print("e2e: FAILED: " + "; ".join(problems))
    sys.exit(1)
print("e2e: passed")
EOF
