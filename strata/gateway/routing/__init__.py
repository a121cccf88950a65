"""Where a request goes: the instance set (instances.py) fed by a registry or static URLs
(sources.py) and kept honest by health checks and outlier ejection (health.py); the pipeline of
filters and a policy (pipeline.py, policies/); the prefix index of `cache_aware` (prefix/); the
prefill/decode decision and hand-off (pd.py); the LoRA adapters' series of `adapter_aware`
(adapter_metrics.py)."""
