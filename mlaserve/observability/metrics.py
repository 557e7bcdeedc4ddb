"""Prometheus metrics of one server: a registry per server (not prometheus-client's global one),
so one process (a test) can run several servers.

Fed from three places: the HTTP front end (status, latency, tokens of each finished request),
the engine loop's stats snapshot (queue depth, running requests, pages; read at scrape time),
and the route ledger (attention tokens by path / sparse / phase, preemptions; one record per step).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets in seconds: a tiny CPU model answers in milliseconds, a large one in seconds.
_TTFT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    def __init__(self, stats: Callable[[], object] | None = None) -> None:
        """stats(): the engine loop's latest EngineStats (num_running, num_waiting, pages_used, pages_total)."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mlaserve_requests", "finished HTTP requests by status code", ["status"], registry=r)
        self.prompt_tokens = Counter("mlaserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("mlaserve_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram(
            "mlaserve_time_to_first_token_seconds", "arrival to first token", buckets=_TTFT, registry=r
        )
        self.tpot = Histogram(
            "mlaserve_time_per_output_token_seconds", "mean gap between output tokens", buckets=_TPOT, registry=r
        )
        self.e2e = Histogram("mlaserve_e2e_request_latency_seconds", "arrival to last byte", buckets=_E2E, registry=r)
        self.prefix_hits = Counter(
            "mlaserve_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache", registry=r
        )
        self.preemptions = Counter("mlaserve_preemptions", "requests preempted (pages freed, recomputed)", registry=r)
        self.attention_tokens = Counter(
            "mlaserve_attention_tokens",
            "tokens through each attention route (from the route ledger)",
            ["path", "sparse", "phase"],
            registry=r,
        )
        # Speculative decoding (from the ledger's accept records): acceptance rate = accepted / proposed,
        # mean accepted length = (accepted + verifications) / verifications.
        self.spec_proposed = Counter("mlaserve_spec_draft_tokens", "MTP draft tokens proposed", registry=r)
        self.spec_accepted = Counter("mlaserve_spec_accepted_tokens", "MTP draft tokens accepted", registry=r)
        self.spec_verifications = Counter(
            "mlaserve_spec_verifications", "(request, step) pairs that verified drafts", registry=r
        )
        self.spec_mtp_tokens = Counter("mlaserve_spec_mtp_tokens", "tokens through the MTP draft layer", registry=r)
        self.spec_decisions = Counter(
            "mlaserve_spec_switch_decisions",
            "(request, step) pairs by the acceptance switch's decision: on, probe, paused, batch, switch off",
            ["decision"],
            registry=r,
        )
        self.spec_pauses = Counter("mlaserve_spec_pauses", "times the acceptance switch paused a request", registry=r)
        self.spec_resumes = Counter("mlaserve_spec_resumes", "times a probe turned drafting back on", registry=r)
        gauges = {
            "mlaserve_queue_depth": ("requests waiting for admission", "num_waiting"),
            "mlaserve_running_requests": ("requests in the running batch", "num_running"),
            "mlaserve_kv_pages_in_use": ("latent-cache pages held by live requests", "pages_used"),
            "mlaserve_kv_pages_total": ("latent-cache pages in the pool", "pages_total"),
            # models with request-addressed states (a slot each running request holds); 0 for the others
            "mlaserve_state_slots_in_use": ("request-state slots held by running requests", "slots_used"),
            "mlaserve_state_slots_total": (
                "request-state slots (max_num_seqs; 0 without request states)",
                "slots_total",
            ),
        }
        for name, (doc, attr) in gauges.items():
            g = Gauge(name, doc, registry=r)
            if stats is not None:
                g.set_function(lambda attr=attr: float(getattr(stats(), attr)))

    def on_route(self, rec: dict) -> None:
        """One route-ledger record (a step): count tokens per segment, and the preemptions; speculative
        decoding's accept and draft records feed the spec counters (the MTP's passes are not trunk routes)."""
        phase = rec.get("spec_phase")
        if phase == "accept":
            self.spec_proposed.inc(rec["num_proposed_tokens"])
            self.spec_accepted.inc(rec["num_accepted_tokens"])
            self.spec_verifications.inc(len(rec["requests"]))
            return
        if phase == "draft":
            self.spec_mtp_tokens.inc(rec["num_tokens"])
            return
        if phase == "switch":
            for e in rec["requests"]:
                self.spec_decisions.labels(e["decision"]).inc()
            self.spec_pauses.inc(rec["num_pauses"])
            self.spec_resumes.inc(rec["num_resumes"])
            return
        for seg in rec.get("segments", ()):
            self.attention_tokens.labels(seg["path"], str(seg["sparse"]).lower(), seg["phase"]).inc(seg["num_tokens"])
        if rec.get("preempted"):
            self.preemptions.inc(len(rec["preempted"]))

    def on_finished(self, status: int, prompt_tokens: int, output_tokens: int, timing: dict) -> None:
        self.requests.labels(str(status)).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        for key, hist in (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e)):
            if timing.get(key) is not None:
                hist.observe(timing[key])
        self.prefix_hits.inc(timing.get("cached_tokens", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RouteTap:
    """A route-ledger sink for the server: keeps the last `maxlen` step records in a ring (for
    /debug/routes) and feeds each to the metrics; optionally also writes a JSONL file (--trace)."""

    enabled = True

    def __init__(self, ring, on_record: Callable[[dict], None], also=None) -> None:
        self.ring, self.on_record, self.also = ring, on_record, also

    def record(self, rec: dict) -> None:
        self.ring.record(rec)
        self.on_record(rec)
        if self.also is not None:
            self.also.record(rec)

    def close(self) -> None:
        if self.also is not None:
            self.also.close()
