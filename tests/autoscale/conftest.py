"""The autoscaler tests reuse the gateway's fakes (tests/gateway/gateway_fakes.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "gateway"))
