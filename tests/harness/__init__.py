"""Test harnesses shared by the tests and the bench scripts (not part of the product package).

    procs           processes a test starts: logs, bounded waits, stop by PID
    pooled_http     HTTP through one kept-alive client per thread (no client built per call)
    redis_server    a real redis-server on the loopback
    tcp_proxy       a TCP proxy that injects faults (resets, delays, blackholes)
    chaos_load      closed-loop load that records every acknowledged turn
    faults, fault_scenarios   the chaos suite's faults, each verified as applied
    mutations, fuzz the mutation fuzzer and its judge
    checks          what a completion's answer must look like
    default_parallel  the default model split across ranks against one process (its rule)
    serve_zygote    `strata serve` processes forked from one that imported torch once

The bench scripts reach them through the `bench/harness` link.
"""
