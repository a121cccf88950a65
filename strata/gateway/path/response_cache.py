"""The opt-in response cache of the gateway: a deterministic request asked again is answered
from the state store without reaching an instance.

What is cached (`cache_key` answers None for everything else, and the request goes on as usual):
- `POST /v1/completions` and `/v1/chat/completions` only;
- deterministic requests: `temperature` 0, or a fixed integer `seed` (the instance seeds choice
  i with seed + i, so n > 1 reproduces too). An absent or null temperature is OpenAI's default
  of 1: random, not cached unless seeded;
- not streamed: `stream: true` bypasses the cache (a stream's value is its timing);
- not in a session: a body `session_id` bypasses it (the caller also skips X-Session-Id
  requests: the answer depends on history the body does not show);
- logprobs are cached: they are part of the same deterministic answer, and the logprobs fields
  are in the key, so a request without them never gets an answer with them or the reverse.

The key is `infer:{model}:{version}:{sha256}` over a canonical JSON (sorted keys, no whitespace)
of the path and the body, minus the fields that cannot change the output (`stream`,
`stream_options`, `user`, `priority`), with `model` replaced by `name@version`. The version is in
the key and in the hash, so nothing computed by v1 is ever looked up for v2; as a second guard,
an answer is stored only if its `system_fingerprint` says the key's `name@version` computed it.
`cache_salt` stays in the key: tenants that salt their prefix cache do not share answers either.
On a gateway with client keys the caller's tenant (the sha256 of its key, as the instances name
it) is hashed too: one tenant's answer, which shows its prompt was asked, never serves another.
Numbers are hashed as written: `"temperature": 0` and `0.0` are two keys (a miss, never wrong).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from typing import Any

from strata.clock import Clock
from strata.errors import ConfigError, ResponseCacheError
from strata.state.response_cache import ResponseCache

logger = logging.getLogger("strata.gateway.path.response_cache")

CACHEABLE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
OUTPUT_NEUTRAL_FIELDS = frozenset({"stream", "stream_options", "user", "priority"})
FINISHED_REASONS = frozenset({"stop", "length"})  # not abort, error or None (cut short)
OPENAI_DEFAULT_TEMPERATURE = 1.0
KEY_PREFIX = "infer"
CACHE_HEADER = "x-strata-cache"  # on answers: hit, or miss (and stored if storable)


def cache_key(path: str, body: dict[str, Any], *, model: str, version: str,
              tenant: str = "") -> str | None:
    """The cache key of a request to `model` at `version` from `tenant` ("": a gateway without
    keys), or None when it must not be cached (see the module docstring). `model` and `version`
    are the resolved ones the request is routed to; without a version there is no key."""
    if not model or not version or path not in CACHEABLE_PATHS or not isinstance(body, dict):
        return None
    if body.get("stream", False) is not False or "session_id" in body:
        return None
    if not is_deterministic(body):
        return None
    kept = {name: value for name, value in body.items() if name not in OUTPUT_NEUTRAL_FIELDS}
    kept["model"] = f"{model}@{version}"
    try:
        canonical = json.dumps([path, kept, tenant] if tenant else [path, kept],
                               sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):  # NaN or a value JSON cannot hold: leave it to the instance
        return None
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    return f"{KEY_PREFIX}:{model}:{version}:{digest}"


def is_deterministic(body: dict[str, Any]) -> bool:
    """True when the same body always gets the same answer from the same model version."""
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return True
    temperature = body.get("temperature")
    if temperature is None:
        temperature = OPENAI_DEFAULT_TEMPERATURE
    is_number = isinstance(temperature, int | float) and not isinstance(temperature, bool)
    return is_number and temperature == 0


class ResponseCacheLayer:
    """Looks answers up and stores them; never raises for the backend (a failure is logged,
    counted in `errors`, and the request goes on uncached)."""

    def __init__(self, cache: ResponseCache, *, ttl_s: float | None = None,
                 clock: Clock = time.time, is_per_tenant: bool = False) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError(f"response cache ttl_s must be positive, got {ttl_s}")
        self.cache = cache
        self.is_per_tenant = is_per_tenant  # keys carry the caller's tenant (client keys on)
        self.ttl_s = ttl_s  # None: the cache's own TTL
        self.clock = clock
        # plain counters for /metrics
        self.hits = 0
        self.misses = 0
        self.stores = 0
        self.skipped = 0  # answers not stored: not 200, unfinished, not JSON, other version, size
        self.errors = 0
        self._is_failing = False

    async def lookup(self, key: str) -> bytes | None:
        """A fresh response body for `key` (the cached answer with a new `id` and `created`,
        so ids stay unique), or None on a miss."""
        try:
            cached = await self.cache.get(key)
        except ResponseCacheError as exc:
            self._failed("lookup", exc)
            return None
        self._recovered()
        fresh = None if cached is None else self._refresh(key, cached)
        if fresh is None:
            self.misses += 1
        else:
            self.hits += 1
        return fresh

    async def store(self, key: str, status_code: int, body: bytes) -> None:
        """Keep `body` under `key` if it is a 200 JSON answer whose choices all finished and
        that the key's model version computed."""
        if not is_storable(key, status_code, body):
            self.skipped += 1
            return
        try:
            is_stored = await self.cache.put(key, body, ttl_s=self.ttl_s)
        except ResponseCacheError as exc:
            self._failed("store", exc)
            return
        self._recovered()
        if is_stored:
            self.stores += 1
        else:
            self.skipped += 1

    async def close(self) -> None:
        await self.cache.close()

    def _refresh(self, key: str, cached: bytes) -> bytes | None:
        try:
            answer = json.loads(cached)
            kind = str(answer["id"]).rpartition("-")[0] or "cmpl"
        except (ValueError, TypeError, KeyError) as exc:  # cannot happen unless the store lies
            self.errors += 1
            logger.warning("response cache entry %s is not a stored answer: %s", key, exc)
            return None
        answer["id"] = f"{kind}-{uuid.uuid4().hex}"
        answer["created"] = int(self.clock())
        return json.dumps(answer, separators=(",", ":")).encode()

    def _failed(self, what: str, exc: ResponseCacheError) -> None:
        self.errors += 1
        if not self._is_failing:  # one warning per outage, not one per request
            logger.warning("response cache %s failed, serving uncached: %s", what, exc)
        self._is_failing = True

    def _recovered(self) -> None:
        if self._is_failing:
            logger.info("response cache answers again")
        self._is_failing = False


def is_storable(key: str, status_code: int, body: bytes) -> bool:
    """A 200 JSON answer with at least one choice, every choice finished (stop or length), and
    computed by the model version named in `key` (its `system_fingerprint` ends in
    `:name@version`)."""
    if status_code != 200:
        return False
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(answer, dict) or not isinstance(answer.get("id"), str):
        return False
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    if not all(isinstance(c, dict) and c.get("finish_reason") in FINISHED_REASONS
               for c in choices):
        return False
    return _is_computed_by(key, answer.get("system_fingerprint"))


def _is_computed_by(key: str, fingerprint: object) -> bool:
    """`strata-X.Y:name@version` (what an instance writes) against `infer:name:version:`."""
    if not isinstance(fingerprint, str):
        return False
    name, at, version = fingerprint.partition(":")[2].partition("@")
    return bool(at) and key.startswith(f"{KEY_PREFIX}:{name}:{version}:")


__all__ = ["CACHEABLE_PATHS", "CACHE_HEADER", "OUTPUT_NEUTRAL_FIELDS", "ResponseCacheLayer",
           "cache_key", "is_deterministic", "is_storable"]
