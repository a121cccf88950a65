"""Prefill/decode hand-off ("P/D"), the instance's side (the gateway's side:
strata/gateway/routing/pd.py; the exchange drawn in strata/protocol/pd.py).

    config    PDConfig: lease length, pull limits, fault points for tests
    state     PD: the feature's parts on one instance (leases, peers, faults, metrics)
    wire      the handle and the byte format of a pull (head, block frames, checksums)
    layout    the handshake: what this instance's KV bytes mean, compared field by field
    leases    P: the blocks each answered handle holds, until acknowledged or expired
    prefill   P: compute the prompt, hold its blocks, answer a handle, serve pulls
    decode    D: pull the blocks a handle names, check each, decode from P's first token
    routes    the /internal/prefill, /internal/decode and /internal/kv routes
    metrics   strata:pd_* on the instance's registry
    faults    kill points and damaged blocks, for the failure tests
"""
