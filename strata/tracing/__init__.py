"""Per-request tracing with OpenTelemetry: one trace per client request, from the gateway to every
instance it touched, linked by the W3C `traceparent` header.

Off by default; `--otlp-endpoint URL` turns it on for `strata gateway` and `strata serve`
(`--trace-sample-ratio` samples a share of the traces: the gateway's decision holds downstream,
as the sampler follows a sampled parent). Off, nothing is installed: the gateway's path is not
wrapped, no middleware runs, and the few calls left on the path (`span`, `annotate`, `inject`)
return after one check of the module's tracer.

    setup.py    TracingConfig (the flags), the provider with its exporter, start / stop
    spans.py    the calls the layers make: span, annotate, inject, record (a span after the fact)
    asgi.py     TraceRequests: the server span of each HTTP request, its parent from `traceparent`

The spans (names as exported):

    strata.gateway <path>            the client's request at the gateway (server span)
      strata.gateway.step.<Step>       each path step (strata/gateway/path/forward.py)
        strata.gateway.admission_wait    the wait for an admission slot
        strata.gateway.pd.prefill        the prefill call of a hand-off (the P/D decision's reason)
      strata.gateway.route             the routing decision: policy, instance, candidates tried
      strata.gateway.attempt           one attempt on one instance, to its first byte
      strata.gateway.resume            a broken stream resumed elsewhere (its attempts inside)
    strata.instance <path>           the request at an instance (server span, child of an attempt)
      strata.pd.handle                 P's handle for a prefilled prompt
      strata.pd.pull                   D's pull of P's blocks: bytes, blocks, what the checks found
      strata.engine.request            one engine request: tokens, preemptions, finish reason
        strata.engine.queue_wait         arrival to first admission
        strata.engine.kv_import          pulled or fetched blocks written into the cache
        strata.engine.prefill_chunk      one chunk of the prompt, submit to collect
        strata.engine.decode             first token to finish, with the token count
        strata.engine.preempted          preempted until admitted again

The engine knows nothing of this: it fills a plain `PhaseTimeline` (strata/engine/timeline.py)
on requests that carry one, and the server turns it into spans (strata/server/phase_spans.py).
"""

from strata.tracing.asgi import TraceRequests
from strata.tracing.setup import TracingConfig, is_on, start, stop, tracer_provider
from strata.tracing.spans import annotate, current_trace_id, inject, note, record, span

__all__ = ["TraceRequests", "TracingConfig", "annotate", "current_trace_id", "inject", "is_on",
           "note", "record", "span", "start", "stop", "tracer_provider"]
