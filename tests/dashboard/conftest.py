"""The dashboard tests' helpers live beside them (headless_chromium.py); they also use the
gateway tests' fakes (tests/gateway/gateway_fakes.py)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "gateway"))
