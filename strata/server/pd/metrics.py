"""`strata:pd_*`: the hand-offs an instance took part in, on the server's metrics registry.

    pd_handoffs_total{side,outcome}      prefill: answered | refused | cancelled (its caller
                                         left first); decode: pulled (every
                                         block wanted arrived), partial (some recomputed),
                                         local (no usable handle: prefilled here)
    pd_pull_bytes_total{side}            bytes of blocks sent (prefill) or received (decode)
    pd_pull_seconds                      a decode instance's pull, first byte to last block
    pd_pulls_total{transport}            a decode instance's pulls: shm (from the pool of a P
                                         on this host, pd/shm.py) or http (the stream)
    pd_blocks_held                       blocks held under leases now (gauge)
    pd_lease_releases_total{reason}      acked, expired, broken (D died mid-pull), shutdown
    pd_blocks_recomputed_total{reason}   blocks D recomputed instead of importing: hash,
                                         checksum, truncated (stream cut), unavailable (P
                                         answered no stream: acknowledged, expired, restarted);
                                         a payload the executor refuses counts in
                                         kv_decode_failures_total
    pd_handshake_refusals_total{field}   peers refused: the first field that differs
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_PULL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class PDMetrics:
    def __init__(self, reg: CollectorRegistry) -> None:
        self.handoffs = Counter("strata:pd_handoffs_total", "Prefill/decode hand-offs.",
                                ["side", "outcome"], registry=reg)
        self.pull_bytes = Counter("strata:pd_pull_bytes_total", "Bytes of KV blocks pulled.",
                                  ["side"], registry=reg)
        self.pull_s = Histogram("strata:pd_pull_seconds", "Time to pull a prompt's blocks.",
                                buckets=_PULL_BUCKETS_S, registry=reg)
        self.pulls = Counter("strata:pd_pulls_total", "Pulls of a prompt's blocks, by transport.",
                             ["transport"], registry=reg)
        self.blocks_held = Gauge("strata:pd_blocks_held", "KV blocks held under leases.",
                                 registry=reg)
        self.releases = Counter("strata:pd_lease_releases_total", "Leases ended, by reason.",
                                ["reason"], registry=reg)
        self.recomputed = Counter("strata:pd_blocks_recomputed_total",
                                  "Blocks recomputed instead of imported, by reason.",
                                  ["reason"], registry=reg)
        self.refusals = Counter("strata:pd_handshake_refusals_total",
                                "Peers refused by the layout handshake.", ["field"],
                                registry=reg)
        for side in ("prefill", "decode"):
            self.pull_bytes.labels(side)
        for transport in ("shm", "http"):
            self.pulls.labels(transport)
        for reason in ("acked", "expired", "unpulled", "broken"):
            self.releases.labels(reason)  # shown (as 0) before the first event


__all__ = ["PDMetrics"]
