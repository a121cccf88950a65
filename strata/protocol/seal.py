"""A seal over a JSON object: an HMAC-SHA256, keyed by the fleet's internal key, over every
field of it, so that an instance can tell an object a member of its fleet wrote (the gateway's
hand-off handle: strata/protocol/pd.py) from one anybody else made up.

    sealed = seal({"handle": "...", "url": "http://p:8000", ...}, key)   # adds "seal"
    is_sealed(sealed, keys)   # True: no field was added, dropped or changed since

The MAC covers the object's canonical JSON (keys sorted, no spaces) without the `seal` field;
a float survives a JSON round trip exactly (Python writes its shortest repr), so the object
read back from the wire hashes as the one written. Any of `keys` may have sealed it (the first
seals; the others are still taken while keys rotate).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from typing import Any

SEAL_FIELD = "seal"


def _mac(fields: Mapping[str, Any], key: str) -> str:
    body = {name: value for name, value in fields.items() if name != SEAL_FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()


def seal(fields: Mapping[str, Any], key: str) -> dict[str, Any]:
    """`fields` with its seal under `key`."""
    return {**fields, SEAL_FIELD: _mac(fields, key)}


def is_sealed(fields: Mapping[str, Any], keys: Sequence[str]) -> bool:
    """Whether one of `keys` sealed `fields` as they are (compared in constant time, against
    every key)."""
    presented = fields.get(SEAL_FIELD)
    if not isinstance(presented, str):
        return False
    try:
        macs = [_mac(fields, key) for key in keys]
    except (TypeError, ValueError):  # not JSON as written: nobody sealed it
        return False
    matched = [hmac.compare_digest(presented, mac) for mac in macs]
    return any(matched)


__all__ = ["SEAL_FIELD", "is_sealed", "seal"]
