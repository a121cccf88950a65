"""Two ranks in two network namespaces, each with its own address on a veth pair (as two
machines on one link; tests/netns_pair.py): their gloo group sums right, and when the link is
cut (nothing closes, as a pulled cable) rank 0 fails within 5 s naming rank 1, and rank 1,
cut off from rank 0's heartbeats, exits 3 by itself. Needs root (the `netns` tool)."""

from __future__ import annotations

import pytest
from netns_pair import ADDR, NS, make_link, remove_link, run_pair

from strata.model.parallel.comm import free_port

pytestmark = pytest.mark.needs("netns")


def test_ranks_in_two_namespaces_sum_and_a_cut_link_fails_them_within_5_s() -> None:
    make_link()
    try:
        lines, detected, codes = run_pair(NS, ADDR[0], 0, True, free_port("127.0.0.1"))
    finally:
        remove_link()
    assert "sum [3.0, 3.0, 3.0, 3.0]" in lines
    failed = [line for line in lines if line.startswith("failed at")]
    assert failed and "rank 1: rank 1 sent no heartbeat" in failed[0], lines
    assert detected is not None and detected < 5.0
    assert codes == [3, 3]
