"""Drain a Strata instance before it stops (the Kubernetes preStop hook; stdlib only).

    python drain.py [--url http://127.0.0.1:8000] [--timeout-s 60] [--key-file FILE]

POST /admin/drain makes the instance refuse new requests (503, which the gateway retries on
another instance) and, with a registry, report DRAINING and deregister once idle; this script
then polls GET /load until no request is in flight, or until --timeout-s. It always exits 0
when the instance answered the drain, so that the SIGTERM that follows (uvicorn's graceful
shutdown) still runs; it exits 1 only when the drain itself failed. An instance's /admin/drain
takes the fleet's internal key or the admin key: the first line of --key-file, else the first
of STRATA_INTERNAL_KEYS, else of STRATA_ADMIN_KEYS (a client key never drains an instance).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request


def api_key(key_file: str | None) -> str | None:
    if key_file:
        with open(key_file) as f:
            keys = [line.strip() for line in f if line.strip()]
            return keys[0] if keys else None
    for name in ("STRATA_INTERNAL_KEYS", "STRATA_ADMIN_KEYS"):
        keys = [k.strip() for k in os.environ.get(name, "").split(",") if k.strip()]
        if keys:
            return keys[0]
    return None


def call(url: str, method: str, key: str | None, timeout_s: float = 5.0) -> dict:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read() or b"{}")


def drain(base_url: str, timeout_s: float, poll_s: float, key: str | None) -> int:
    base_url = base_url.rstrip("/")
    try:
        started = call(f"{base_url}/admin/drain", "POST", key)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"drain: POST {base_url}/admin/drain failed: {exc}", file=sys.stderr, flush=True)
        return 1
    in_flight = int(started.get("num_in_flight", 0))
    print(f"drain: draining, {in_flight} request(s) in flight", flush=True)
    deadline = time.monotonic() + timeout_s
    while in_flight > 0 and time.monotonic() < deadline:
        time.sleep(poll_s)
        try:
            in_flight = int(call(f"{base_url}/load", "GET", None).get("num_in_flight", 0))
        except (urllib.error.URLError, OSError, ValueError):
            break  # the server is going away already: nothing left to wait for here
    if in_flight > 0:
        print(f"drain: {in_flight} request(s) still in flight after {timeout_s}s",
              file=sys.stderr, flush=True)
    else:
        print("drain: idle", flush=True)
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--key-file", default=None,
                        help="the internal or the admin key, first line")
    args = parser.parse_args(argv)
    return drain(args.url, args.timeout_s, args.poll_s, api_key(args.key_file))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
