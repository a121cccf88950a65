"""Exit 0 when GET URL answers 2xx, else 1: the container health check (stdlib only).

    python probe.py http://127.0.0.1:8000/ready [--timeout-s 2]

python:3.11-slim has no curl; /health, /ready and /metrics need no API key.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    try:
        with urllib.request.urlopen(args.url, timeout=args.timeout_s) as response:
            return 0 if 200 <= response.status < 300 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"probe: {args.url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
