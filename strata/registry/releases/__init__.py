"""Releases: a leased, resumable state machine that moves a model's live pointer (blue-green,
canary with automatic rollback, rollback).

    controller  ReleaseController: drives releases to their end, one step at a time
    steps       each step of a release (start the new version, wait until ready, flip, retire)
    effects     what a step changes in the registries (deployments laid out in pools)
    adapter_steps  a LoRA adapter version's release: loaded into the base's running instances,
                warmed, flipped, the old one unloaded (no instance starts or stops)
    adapter_sync   instances started later load the adapter versions that take traffic
    policy      ReleaseConfig, warming and the canary's verdict
    health      per-version health windows that the canary is judged on

Nothing is imported here: the model registry's records import `health`, and the controller
imports the model registry.
"""
