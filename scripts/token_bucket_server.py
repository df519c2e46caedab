#!/usr/bin/env python3
"""An independent rate-limited HTTP server for burstgate's end-to-end check.

It knows nothing of burstgate: it keeps one token bucket per Authorization header value, in
floating-point seconds on the monotonic clock, starting full at the first request it receives,
with no tolerance. A request finds a token and is answered 200, or is answered
429 Too Many Requests with Retry-After and X-Ratelimit-Retry (whole seconds, rounded up, at
least 1), and a line on stderr saying how far away the next token was. Any method, any path.

    usage: token_bucket_server.py PORT RATE BURST [SECONDS]

RATE is tokens per second (a decimal is fine), BURST the bucket's size. It listens on
127.0.0.1:PORT only. On SIGTERM or SIGINT, or after SECONDS when given, it stops and prints its
totals as one line:

    totals: received N, admitted A, rejected R, accounts K, first_ms F, last_ms L

where F and L are the wall-clock arrival times (milliseconds since the Unix epoch) of the first
and the last request it received.
"""

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

    def take(self, account):
        """Returns None when admitted, else the seconds until a token is there."""
        with self.lock:
            now = time.monotonic()
            wall_ms = time.time() * 1000.0
            if self.first_ms is None:
                self.first_ms = wall_ms
                self.first_monotonic = now
            self.last_ms = wall_ms
            bucket = self.buckets.get(account)
            if bucket is None:
                bucket = [float(self.burst), now]
                self.buckets[account] = bucket
            tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
            bucket[1] = now
            if tokens >= 1.0:
                bucket[0] = tokens - 1.0
                self.admitted += 1
                return None
            bucket[0] = tokens
            self.rejected += 1
            wait = (1.0 - tokens) / self.rate
            since = (now - self.first_monotonic) * 1000.0
            print(f"429 at {since:.3f} ms: a token is {wait * 1000.0:.3f} ms away",
                  file=sys.stderr, flush=True)
            return wait

    def totals(self):
        with self.lock:
            first = -1 if self.first_ms is None else int(self.first_ms)
            last = -1 if self.last_ms is None else int(self.last_ms)
            return (
                f"totals: received {self.admitted + self.rejected}, admitted {self.admitted}, "
                f"rejected {self.rejected}, accounts {len(self.buckets)}, "
                f"first_ms {first}, last_ms {last}"
            )


def handler_for(buckets):
    class Handler(BaseHTTPRequestHandler):
        # Keep-alive, as an API behind a real load balancer would.
        protocol_version = "HTTP/1.1"

        def handle_any(self):
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            wait = buckets.take(self.headers.get("Authorization", ""))
            if wait is None:
                self.reply(200, b"ok\n", [])
            else:
                secs = str(max(1, math.ceil(wait)))
                headers = [("Retry-After", secs), ("X-Ratelimit-Retry", secs)]
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
    if len(argv) not in (4, 5):
        print("usage: token_bucket_server.py PORT RATE BURST [SECONDS]", file=sys.stderr)
        return 2
    port, rate, burst = int(argv[1]), float(argv[2]), int(argv[3])
    seconds = float(argv[4]) if len(argv) == 5 else None
    if rate <= 0 or burst < 1:
        print("RATE must be above 0 and BURST at least 1", file=sys.stderr)
        return 2

    buckets = Buckets(rate, burst)
    server = ThreadingHTTPServer(("127.0.0.1", port), handler_for(buckets))
    server.daemon_threads = True
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    print(f"listening on 127.0.0.1:{port}, rate {rate}/s, burst {burst}", flush=True)
    stop.wait(seconds)
    server.shutdown()
    print(buckets.totals(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
