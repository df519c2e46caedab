#!/usr/bin/env python3
"""An independent rate-limited HTTP server for burstgate's end-to-end check.

It knows nothing of burstgate: it keeps one token bucket per Authorization header value, in
floating-point seconds on the monotonic clock, starting full at the first request it receives,
with no tolerance. A request finds a token and is answered 200, or is answered
429 Too Many Requests with Retry-After and X-Ratelimit-Retry (whole seconds, rounded up, at
least 1), and a line on stderr saying how far away the next token was. Any method, any path.

    usage: token_bucket_server.py PORT RATE BURST [SECONDS] [--report-remaining]
                                  [--foreign FRACTION --foreign-account VALUE]

RATE is tokens per second (a decimal is fine), BURST the bucket's size. It listens on
127.0.0.1:PORT only. With --report-remaining every answer carries X-Ratelimit-Remaining, the
whole tokens left after it. With --foreign, a consumer inside the server spends the bucket of the
account whose Authorization header is VALUE at FRACTION of RATE, evenly, from the first request
the server receives: another integration spending the same account's budget. On SIGTERM or
SIGINT, or after SECONDS when given, it stops and prints its totals as one line:

    totals: received N, admitted A, rejected R, accounts K, first_ms F, last_ms L,
            foreign_admitted FA, foreign_rejected FR

where N, A and R count HTTP requests, F and L are the wall-clock arrival times (milliseconds
since the Unix epoch) of the first and the last request it received, and FA and FR the foreign
consumer's takes. A second line, `foreign_ms: T1 T2 ...`, gives the wall-clock time of each
take the foreign consumer was admitted.
"""

import argparse
import math
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Buckets:
    """One token bucket per account, behind one lock."""

    def __init__(self, rate, burst):
        self.rate = rate
        self.burst = burst
        self.lock = threading.Lock()
        self.buckets = {}  # account -> [tokens, monotonic time]
        self.admitted = 0
        self.rejected = 0
        self.first_ms = None
        self.first_monotonic = None
        self.last_ms = None
        self.started = threading.Event()
        self.foreign_admitted = 0
        self.foreign_rejected = 0
        self.foreign_ms = []  # wall-clock times of the foreign consumer's admitted takes

    def take(self, account, foreign=False):
        """Returns (None, tokens left) when admitted, else (the seconds until a token is
        there, 0)."""
        with self.lock:
            now = time.monotonic()
            if not foreign:
                wall_ms = time.time() * 1000.0
                if self.first_ms is None:
                    self.first_ms = wall_ms
                    self.first_monotonic = now
                    self.started.set()
                self.last_ms = wall_ms
            bucket = self.buckets.get(account)
            if bucket is None:
                bucket = [float(self.burst), now]
                self.buckets[account] = bucket
            tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
            bucket[1] = now
            if tokens >= 1.0:
                bucket[0] = tokens - 1.0
                if foreign:
                    self.foreign_admitted += 1
                    self.foreign_ms.append(int(time.time() * 1000.0))
                else:
                    self.admitted += 1
                return None, int(bucket[0])
            bucket[0] = tokens
            wait = (1.0 - tokens) / self.rate
            if foreign:
                self.foreign_rejected += 1
                return wait, 0
            self.rejected += 1
            since = (now - self.first_monotonic) * 1000.0
            print(f"429 at {since:.3f} ms: a token is {wait * 1000.0:.3f} ms away",
                  file=sys.stderr, flush=True)
            return wait, 0

    def totals(self):
        with self.lock:
            first = -1 if self.first_ms is None else int(self.first_ms)
            last = -1 if self.last_ms is None else int(self.last_ms)
            return (
                f"totals: received {self.admitted + self.rejected}, admitted {self.admitted}, "
                f"rejected {self.rejected}, accounts {len(self.buckets)}, "
                f"first_ms {first}, last_ms {last}, "
                f"foreign_admitted {self.foreign_admitted}, "
                f"foreign_rejected {self.foreign_rejected}"
            )


def foreign_consumer(buckets, account, rate, stop):
    """Spends `account`'s bucket `rate` times a second, evenly, from the first request on."""
    while not buckets.started.wait(0.05):
        if stop.is_set():
            return
    period = 1.0 / rate
    due = time.monotonic()
    while not stop.is_set():
        buckets.take(account, foreign=True)
        due += period
        delay = due - time.monotonic()
        if delay > 0:
            stop.wait(delay)


def handler_for(buckets, report_remaining):
    class Handler(BaseHTTPRequestHandler):
        # Keep-alive, as an API behind a real load balancer would.
        protocol_version = "HTTP/1.1"

        def handle_any(self):
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            wait, left = buckets.take(self.headers.get("Authorization", ""))
            headers = [("X-Ratelimit-Remaining", str(left))] if report_remaining else []
            if wait is None:
                self.reply(200, b"ok\n", headers)
            else:
                secs = str(max(1, math.ceil(wait)))
                headers += [("Retry-After", secs), ("X-Ratelimit-Retry", secs)]
                self.reply(429, b"too many requests\n", headers)

        def reply(self, status, body, headers):
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = handle_any
        do_POST = handle_any
        do_PUT = handle_any
        do_DELETE = handle_any

        def log_message(self, format, *args):
            pass

    return Handler


def main(argv):
    parser = argparse.ArgumentParser(prog="token_bucket_server.py")
    parser.add_argument("port", type=int)
    parser.add_argument("rate", type=float)
    parser.add_argument("burst", type=int)
    parser.add_argument("seconds", type=float, nargs="?")
    parser.add_argument("--report-remaining", action="store_true")
    parser.add_argument("--foreign", type=float, default=0.0, metavar="FRACTION")
    parser.add_argument("--foreign-account", default="", metavar="VALUE")
    args = parser.parse_args(argv[1:])
    port, rate, burst, seconds = args.port, args.rate, args.burst, args.seconds
    if rate <= 0 or burst < 1 or args.foreign < 0:
        print("RATE must be above 0, BURST at least 1, FRACTION at least 0", file=sys.stderr)
        return 2

    buckets = Buckets(rate, burst)
    server = ThreadingHTTPServer(("127.0.0.1", port), handler_for(buckets, args.report_remaining))
    server.daemon_threads = True
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    if args.foreign > 0:
        foreign = threading.Thread(
            target=foreign_consumer,
            args=(buckets, args.foreign_account, args.foreign * rate, stop),
            daemon=True,
        )
        foreign.start()
    print(f"listening on 127.0.0.1:{port}, rate {rate}/s, burst {burst}", flush=True)
    stop.wait(seconds)
    server.shutdown()
    print(buckets.totals(), flush=True)
    with buckets.lock:
        print("foreign_ms:", " ".join(str(t) for t in buckets.foreign_ms), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
