"""Prometheus metrics for one server (its own registry, not prometheus-client's global one).

Names follow vLLM's (`vllm:spec_decode_*` -> `trt_spec:spec_decode_*`):
    requests: running / waiting (gauges), finished by reason, rejected by reason
    tokens:   prompt and generation totals
    KV cache: slots in use and in all; slots kept for the prefix cache
    prefix cache: prompt tokens looked up and found (vLLM's prefix_cache_queries / _hits),
                  requests that found any
    speculative: drafts (stream-steps that drafted), draft tokens, accepted tokens, accepted
                 tokens per draft position
    latency:  end to end and to the first token (histograms)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from trt_spec.runtime.scheduler import Scheduler, StepReport

P = "trt_spec:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class ServerMetrics:
    def __init__(self, scheduler: Scheduler, model_name: str):
        r = self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name, doc, fn):
            g = Gauge(P + name, doc, list(labels), registry=r)
            g.labels(**labels).set_function(fn)

        gauge("num_requests_running", "Requests holding a KV slot.",
              lambda: scheduler.num_running)
        gauge("num_requests_waiting", "Requests queued for a KV slot.",
              lambda: scheduler.num_waiting)
        gauge("kv_cache_slots_used", "KV-cache slots in use.", lambda: scheduler.slots_used)
        gauge("kv_cache_slots_total", "KV-cache slots.", lambda: scheduler.slots)
        gauge("prefix_cache_kept_slots", "Free KV-cache slots keeping a finished request's "
              "rows for the prefix cache.", lambda: scheduler.slots_kept)
        gauge("suffix_cache_tokens", "Tokens of ended requests the suffix lookups' cache "
              "holds (its memory grows with them, up to the bound).",
              lambda: scheduler.suffix_cache_tokens[0])
        gauge("suffix_cache_max_tokens", "The suffix lookups' cache bound (0: no lookup has "
              "run yet).", lambda: scheduler.suffix_cache_tokens[1])

        def counter(name, doc, extra=()):
            return Counter(P + name, doc, [*labels, *extra], registry=r)

        self._finished = counter("request_success", "Finished requests, by reason "
                                 "(stop, length, abort = cancelled or disconnected, error).",
                                 ["finished_reason"])
        self._rejected = counter("request_rejected", "Requests refused before queueing, by "
                                 "reason (invalid = 4xx, queue_full = 429, disconnected = the "
                                 "client left mid-body).", ["reason"])
        self._prompt = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self._pc_queries = counter("prefix_cache_queries", "Prompt tokens of requests admitted "
                                   "with the prefix cache on.")
        self._pc_hits = counter("prefix_cache_hits", "Prompt tokens whose KV came from the "
                                "prefix cache (not read again).")
        self._pc_requests = counter("prefix_cache_hit_requests", "Admitted requests that "
                                    "started from cached rows.")
        self._generation = counter("generation_tokens", "Generated tokens.")
        self._drafts = counter("spec_decode_num_drafts", "Speculative stream-steps that drafted.")
        self._draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self._accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted, by position (0-based).", ["position"])
        self._e2e = Histogram(P + "e2e_request_latency_seconds", "Submit to last token.",
                              list(labels), buckets=LATENCY_BUCKETS, registry=r)
        self._ttft = Histogram(P + "time_to_first_token_seconds", "Submit to first token.",
                               list(labels), buckets=LATENCY_BUCKETS, registry=r)
        self.labels = labels
        self.scheduler = scheduler
        scheduler.on_step = self.observe

    def observe(self, report: StepReport) -> None:
        """Runs on the scheduler thread after every step."""
        lb = self.labels
        prefix = self.scheduler.prefix_caching
        for r in (r for r in report.admitted if r.index == 0):  # a prompt once, whatever n
            n, cached = len(r.stream.prompt_ids), r.stream.stats.cached_tokens
            self._prompt.labels(**lb).inc(n)
            if prefix:
                self._pc_queries.labels(**lb).inc(n)
            if cached:
                self._pc_hits.labels(**lb).inc(cached)
                self._pc_requests.labels(**lb).inc()
        if report.new_tokens:
            self._generation.labels(**lb).inc(report.new_tokens)
        m = report.engine
        if m is not None:
            if m.proposed_tokens:
                self._drafts.labels(**lb).inc(m.speculating_streams)
                self._draft_tokens.labels(**lb).inc(m.proposed_tokens)
                self._accepted.labels(**lb).inc(m.accepted_tokens)
            for pos, n in enumerate(m.accepted_per_position):
                self._per_pos.labels(**lb, position=str(pos)).inc(n)
        for r in report.finished:
            s = r.stream
            self._finished.labels(**lb, finished_reason=s.finish_reason).inc()
            if s.finish_reason in ("stop", "length"):
                self._e2e.labels(**lb).observe(s.stats.t_finished - r.t_submitted)
                if s.stats.t_first_token is not None:
                    self._ttft.labels(**lb).observe(s.stats.t_first_token - r.t_submitted)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(**self.labels, reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
