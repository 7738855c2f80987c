"""/metrics: vLLM's metric names under the `llmpipe:` prefix, in Prometheus text format.

Per-request figures (latency histograms, token and success counters) are observed as outputs
arrive; engine state (running, waiting, KV usage, preemptions, prefix cache) is read from the
async engine's latest stats snapshot at scrape time.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmpipe.engine.engine import EngineStats
from llmpipe.outputs import RequestOutput
from llmpipe.server.async_engine import RequestStream

# vLLM's buckets, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


Snapshots = Callable[[], list[tuple[dict[str, str], EngineStats]]]  # (labels, stats): one engine, or each replica's
ENGINE_METRICS: tuple[tuple[type, str, str, Callable[[EngineStats], float]], ...] = (
    (GaugeMetricFamily, "llmpipe:num_requests_running", "Sequences in the running batch.", lambda s: s.num_running),
    (GaugeMetricFamily, "llmpipe:num_requests_waiting", "Sequences waiting to be scheduled.", lambda s: s.num_waiting),
    (GaugeMetricFamily, "llmpipe:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", lambda s: s.kv_cache_usage),
    (CounterMetricFamily, "llmpipe:num_preemptions", "Preemptions (recompute).", lambda s: s.num_preemptions),
    (CounterMetricFamily, "llmpipe:prefix_cache_queries", "Prompt blocks looked up in the prefix cache.",
     lambda s: s.prefix_cache_queries),
    (CounterMetricFamily, "llmpipe:prefix_cache_hits", "Prompt blocks served by the prefix cache.",
     lambda s: s.prefix_cache_hits),
)
SPEC_METRICS = (
    ("llmpipe:spec_decode_num_drafts", "Speculative proposals verified.", "num_drafts"),
    ("llmpipe:spec_decode_num_draft_tokens", "Tokens proposed.", "num_draft_tokens"),
    ("llmpipe:spec_decode_num_accepted_tokens", "Proposed tokens the target accepted.", "num_accepted_tokens"),
)

OFFLOAD_METRICS = (
    ("llmpipe:kv_offload_saved_blocks", "Prefix-cache blocks copied into the offload tier.", "saved"),
    ("llmpipe:kv_offload_restored_blocks", "Blocks restored from the offload tier instead of recomputed.", "restored"),
    ("llmpipe:kv_offload_disk_reads", "Blocks read back from the disk tier and verified.", "disk_reads"),
    ("llmpipe:kv_offload_rejected_files", "Disk-tier files that failed verification (recomputed).", "rejected"),
)


class _EngineCollector(Collector):
    """Engine state at scrape time; behind a data-parallel ingress, one sample per replica (label `replica`)."""

    def __init__(self, snapshots: Snapshots) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snapshots = self._snapshots()
        names = sorted({name for labels, _ in snapshots for name in labels})
        for family_type, name, doc, value in ENGINE_METRICS:
            yield self._family(family_type, name, doc, names, [(labels, value(s)) for labels, s in snapshots])
        spec = [(labels, s.spec_decode) for labels, s in snapshots if s.spec_decode is not None]
        offload = [(labels, s.kv_offload) for labels, s in snapshots if s.kv_offload is not None]
        for metrics, present in ((SPEC_METRICS, spec), (OFFLOAD_METRICS, offload)):
            for name, doc, attr in metrics if present else ():
                yield self._family(CounterMetricFamily, name, doc, names, [(labels, getattr(d, attr)) for labels, d in present])

    @staticmethod
    def _family(family_type: type, name: str, doc: str, names: list[str], samples: list[tuple[dict, float]]):
        family = family_type(name, doc, labels=names)
        for labels, value in samples:
            family.add_metric([labels[n] for n in names], value)
        return family


class ServerMetrics:
    def __init__(self, snapshots: Snapshots) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("llmpipe:time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("llmpipe:inter_token_latency_seconds", "Inter-token latency.", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(
            "llmpipe:e2e_request_latency_seconds", "Arrival to last token.", buckets=REQUEST_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "llmpipe:request_queue_time_seconds", "Arrival to first scheduled.", buckets=REQUEST_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("llmpipe:prompt_tokens", "Prompt tokens of requests that started.", registry=r)
        self.generation_tokens = Counter("llmpipe:generation_tokens", "Generated tokens.", registry=r)
        self.success = Counter(
            "llmpipe:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        r.register(_EngineCollector(snapshots))

    def observe(self, stream: RequestStream, output: RequestOutput) -> None:
        """Called with every output the engine hands back, in order."""
        generated = sum(len(choice.token_ids) for choice in output.outputs)
        if stream.num_tokens == 0 and generated:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(generated - stream.num_tokens)
        stream.num_tokens = generated
        if output.finished:
            self._observe_finished(output)

    def _observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        for gap in m.itl:
            self.itl.observe(gap)
        self.success.labels(finished_reason=output.outputs[0].finish_reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
