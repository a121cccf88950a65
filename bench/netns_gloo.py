"""The inter-node path between two Linux network namespaces (issue 28 item 5): two ranks, each in
its own namespace with its own address on a veth pair, as two machines on one link
(tests/netns_pair.py sets them up).

Measured on rank 0: a gloo all-reduce of one decode row (576 floats, SmolLM2-135M's hidden size)
and of 32 rows; a pipeline hand-off of 32 rows of hidden states (send to rank 1 and back, halved);
the same in the root namespace over 127.0.0.1 for comparison. Then the link is cut (`ip link set
... down`: nothing closes, as when a cable is pulled) while rank 0 runs all-reduces, and the time
from the cut to rank 0's `RankFailedError` naming rank 1 is reported. Needs root (CAP_NET_ADMIN).

    sudo PYTHONPATH=. .venv/bin/python bench/netns_gloo.py --iters 500 --cuts 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from netns_pair import ADDR, NS, make_link, remove_link, run_pair  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--cuts", type=int, default=3)
    args = parser.parse_args()
    print("loopback (one namespace, 127.0.0.1):")
    print("\n".join(run_pair(None, "127.0.0.1", args.iters, False, 29710)[0]))
    cuts = []
    for i in range(max(args.cuts, 1)):
        make_link()
        try:
            lines, detected, _ = run_pair(NS, ADDR[0], args.iters, True, 29720 + 2 * i)
        finally:
            remove_link()
        if i == 0:
            print("two namespaces over a veth pair:")
            print("\n".join(lines))
        if detected is not None:
            cuts.append(detected)
    print("link cut to rank 0's failure: " + ", ".join(f"{c * 1e3:.0f}" for c in cuts)
          + f" ms (median {statistics.median(cuts) * 1e3:.0f} ms)" if cuts else "no failure")


if __name__ == "__main__":
    main()
