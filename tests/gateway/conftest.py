"""Helpers for the gateway tests live next to them (gateway_fakes, live_fleet); the live tests
also use tests/server/live_server.py."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "server"))
