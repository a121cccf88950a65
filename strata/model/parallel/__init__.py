"""Tensor and pipeline parallel: one model over T x P ranks under one engine (Stage 5)."""
