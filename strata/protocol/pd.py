"""What the gateway and the instances agree on for a prefill/decode hand-off.

    POST {P}/internal/prefill/v1/chat/completions   (or .../v1/completions) the client's body;
         P computes the prompt's KV and first token, holds the blocks under a lease and answers
         a handle (JSON, opaque to the gateway but for `url`)
    POST {D}/internal/decode/v1/chat/completions    the client's body with the handle in
         `X-Strata-Handoff` (the gateway adds P's URL as `url`); D pulls the blocks from P,
         hands out the first token P sampled and decodes on; the answer is the client's
    GET  {P}/internal/kv/layout                      the handshake: what P's KV bytes mean
    GET  {P}/internal/kv/{handle}?start=I&count=N    the pull: a binary stream of blocks
    DELETE {P}/internal/kv/{handle}                  the acknowledgement: P frees the blocks

The client never sends `X-Strata-Handoff` through a gateway: the gateway drops it from every
incoming request (it names a URL an instance would fetch from).
"""

from __future__ import annotations

HANDOFF_HEADER = "x-strata-handoff"
PREFILL_PREFIX = "/internal/prefill"
DECODE_PREFIX = "/internal/decode"
LAYOUT_PATH = "/internal/kv/layout"
KV_PATH = "/internal/kv"
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


def public_path(path: str) -> str:
    """The OpenAI route a hand-off route serves (`/internal/decode/v1/completions` ->
    `/v1/completions`); any other path as it is."""
    for prefix in (PREFILL_PREFIX, DECODE_PREFIX):
        if path.startswith(prefix + "/"):
            return path[len(prefix):]
    return path


__all__ = ["DECODE_PREFIX", "GENERATION_PATHS", "HANDOFF_HEADER", "KV_PATH", "LAYOUT_PATH",
           "PREFILL_PREFIX", "public_path"]
