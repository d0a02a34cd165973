"""The server's Prometheus figures of the engine (``EngineCollector``, read at scrape time); the HTTP status counter
lives with the routes (``app.create_app``)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from spec_engine.server.async_engine import AsyncEngine


class EngineCollector(Collector):
    """Engine figures read from ``AsyncEngine.stats()`` at scrape time (counters are the engine's own totals)."""

    def __init__(self, engine: AsyncEngine, max_pending: int):
        self.engine, self.max_pending = engine, max_pending

    def collect(self):
        s = self.engine.stats()
        finished = CounterMetricFamily("specdec_requests", "requests the engine finished, by reason", labels=["reason"])
        for reason, n in s["num_requests_finished"].items():
            finished.add_metric([reason], n)
        yield finished
        yield CounterMetricFamily("specdec_prompt_tokens", "prompt tokens of accepted requests", s["num_prompt_tokens"])
        yield CounterMetricFamily("specdec_prompt_tokens_cached", "prompt tokens whose K/V came from the prefix cache",
                                  s["num_cached_prompt_tokens"])  # fmt: skip
        yield CounterMetricFamily("specdec_generation_tokens", "generated tokens", s["num_generated_tokens"])
        yield CounterMetricFamily("specdec_num_preemptions", "requests preempted for KV blocks (resumed later, same "
                                  "output)", s["num_preemptions"])  # fmt: skip
        yield GaugeMetricFamily("specdec_num_requests_running", "requests decoding now", s["num_requests_running"])
        yield GaugeMetricFamily("specdec_num_requests_waiting", "requests queued for a slot or KV blocks",
                                s["num_requests_waiting"])  # fmt: skip
        yield GaugeMetricFamily("specdec_num_requests_in_flight", "accepted, unfinished requests (429 above "
                                "specdec_max_pending)", self.engine.num_in_flight)  # fmt: skip
        yield GaugeMetricFamily("specdec_max_pending", "the in-flight bound", self.max_pending)
        yield GaugeMetricFamily("specdec_kv_cache_blocks_used", "KV blocks held by requests", s["kv_blocks_used"])
        yield GaugeMetricFamily("specdec_kv_cache_blocks_total", "KV blocks in the cache", s["kv_blocks_total"])
        usage = s["kv_blocks_used"] / s["kv_blocks_total"] if s["kv_blocks_total"] else 0.0
        yield GaugeMetricFamily("specdec_kv_cache_usage_ratio", "fraction of KV blocks in use", usage)
        yield CounterMetricFamily("specdec_spec_decode_num_steps", "target passes per decoding request", s["num_steps"])
        yield CounterMetricFamily("specdec_spec_decode_num_drafted_tokens", "drafted tokens", s["num_drafted_tokens"])
        yield CounterMetricFamily("specdec_spec_decode_num_accepted_tokens", "drafted tokens the target accepted",
                                  s["num_accepted_tokens"])  # fmt: skip
        yield GaugeMetricFamily("specdec_spec_decode_acceptance_rate", "accepted / drafted", s["acceptance_rate"])
        yield GaugeMetricFamily("specdec_spec_decode_mean_accepted_length", "tau: tokens emitted per target pass",
                                s["mean_accepted_length"])  # fmt: skip
        yield _histogram("specdec_spec_decode_accepted_length", "drafted tokens accepted per target pass",
                         s["accepted_length_hist"])  # fmt: skip
        yield _histogram("specdec_spec_decode_depth", "tree depth chosen per request and step (0 = not drafted)",
                         s["depth_hist"])  # fmt: skip
        yield GaugeMetricFamily("specdec_spec_decode_depth_last", "the deepest row's depth in the last decoding step",
                                s["last_step_depth"])  # fmt: skip
        yield GaugeMetricFamily("specdec_spec_decode_adaptive", "1 when the depth is chosen per step (adaptive)",
                                float(s["adaptive"]))  # fmt: skip


def _histogram(name: str, documentation: str, counts: list[int]) -> HistogramMetricFamily:
    """A Prometheus histogram from integer-valued counts: ``counts[k]`` observations of the value k."""
    cumulative, buckets = 0, []
    for k, n in enumerate(counts):
        cumulative += n
        buckets.append((str(float(k)), cumulative))
    buckets.append(("+Inf", cumulative))
    h = HistogramMetricFamily(name, documentation)
    h.add_metric([], buckets, sum_value=float(sum(k * n for k, n in enumerate(counts))))
    return h
