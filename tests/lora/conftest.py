"""The LoRA tests borrow the gateway's live fleet helpers (a gateway in process on a real
socket), the server's wait and the deploy tests' gateway process."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
for folder in ("server", "gateway", "deploy"):
    sys.path.insert(0, str(HERE.parent / folder))
