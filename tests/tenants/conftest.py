"""The tenants tests (usage per tenant, key budgets) run real gateways over simulated
instances: the gateway helpers are tests/gateway's, the live server's tests/server's."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "server"))
sys.path.insert(0, str(HERE.parent / "gateway"))
