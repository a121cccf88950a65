"""HTTP clients of a Strata server: the terminal chat and the shared SSE reader."""

from __future__ import annotations
