"""Strata: an LLM serving stack that grows from one process to a cluster."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
