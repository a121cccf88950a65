"""Tenants at the gateway: what each one used, and the budgets of the keys that have one.

    usage.py     the usage of one answer (a JSON body, or a stream's frames) as `Counts`
    budgets.py   a key's rpm=/tpm= limits held in the shared store's one-minute window, and the
                 `x-ratelimit-*` headers of an answer
    meter.py     `MeterTenants`, the path step (strata/gateway/path/forward.py): refuses a
                 request over its budget before anything else, then counts the answer
    metrics.py   this gateway's counts on /metrics, top N tenants and models, the rest "other"

The counts and windows live in the usage store (strata/state/usage/), so gateways sharing one
add up; GET /admin/usage reads them back (strata/gateway/control/usage.py).
"""
