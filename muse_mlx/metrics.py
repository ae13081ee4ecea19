"""The server's counters for `GET /metrics` (`--metrics`), under llama-server's names.

The engine thread counts (`on_call` for each forward it runs over the slots: a prefill chunk or a
decode step; `on_finish` for each request that ends); the HTTP side renders them in Prometheus's
text format through prometheus_client. As llama-server's, the two throughput gauges are averages
over the window since the previous scrape (a scrape starts a new window), the rest since start:

    llamacpp:prompt_tokens_total              prompt tokens prefilled (not those from the prompt cache)
    llamacpp:prompt_tokens_cached_total       prompt tokens taken from the prompt cache or a restored pack
    llamacpp:prompt_seconds_total             seconds from requests' admissions to their first tokens' logits
    llamacpp:tokens_predicted_total           tokens generated
    llamacpp:tokens_predicted_seconds_total   seconds from those logits to the requests' ends
    llamacpp:n_decode_total                   forwards run (prefill chunks and decode steps)
    llamacpp:n_tokens_max                     the longest sequence seen (prompt and generation)
    llamacpp:prompt_tokens_seconds            prompt tokens a second (gauge, this window)
    llamacpp:predicted_tokens_seconds         generated tokens a second (gauge, this window)
    llamacpp:requests_processing              slots not idle (gauge)
    llamacpp:requests_deferred                requests waiting for a slot (gauge)
    llamacpp:n_busy_slots_per_decode          slots busy a forward, on average (gauge)
"""

from __future__ import annotations

import threading


class ServerMetrics:
    COUNTERS = (
        ("prompt_tokens", "Number of prompt tokens processed, excluding cached tokens"),
        ("prompt_tokens_cached", "Number of prompt tokens reused from the cache"),
        ("prompt_seconds", "Total time spent processing prompts"),
        ("tokens_predicted", "Number of generation tokens processed"),
        ("tokens_predicted_seconds", "Total time spent generating tokens"),
        ("n_decode", "Total number of forwards over the slots (prefill chunks and decode steps)"),
    )

    def __init__(self):
        self.lock = threading.Lock()
        self.totals = {name: 0.0 for name, _ in self.COUNTERS}
        self.n_busy_slots = 0
        self.n_tokens_max = 0
        self.window = [0, 0.0, 0, 0.0]   # prompt tokens, their seconds, predicted tokens, theirs

    def on_call(self, busy_slots: int) -> None:
        with self.lock:
            self.totals["n_decode"] += 1
            self.n_busy_slots += busy_slots

    def on_finish(self, prompt_n: int, cached_n: int, prompt_s: float, predicted_n: int, predicted_s: float,
                  n_tokens: int) -> None:
        with self.lock:
            t = self.totals
            t["prompt_tokens"] += prompt_n
            t["prompt_tokens_cached"] += cached_n
            t["prompt_seconds"] += prompt_s
            t["tokens_predicted"] += predicted_n
            t["tokens_predicted_seconds"] += predicted_s
            self.n_tokens_max = max(self.n_tokens_max, n_tokens)
            w = self.window
            w[0], w[1], w[2], w[3] = w[0] + prompt_n, w[1] + prompt_s, w[2] + predicted_n, w[3] + predicted_s

    def exposition(self, processing: int, deferred: int) -> bytes:
        """The Prometheus text of the counters now, the gauges over the window since the last call
        (which this call closes)."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self.lock:
            totals, busy, longest, w = dict(self.totals), self.n_busy_slots, self.n_tokens_max, list(self.window)
            self.window = [0, 0.0, 0, 0.0]
        families = [CounterMetricFamily(f"llamacpp:{name}", text, value=totals[name]) for name, text in self.COUNTERS]
        gauges = (
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", longest),
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", w[0] / w[1] if w[1] > 0 else 0.0),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s", w[2] / w[3] if w[3] > 0 else 0.0),
            ("requests_processing", "Number of requests processing", processing),
            ("requests_deferred", "Number of requests deferred", deferred),
            ("n_busy_slots_per_decode", "Average number of busy slots per forward",
             busy / max(totals["n_decode"], 1.0)),
        )
        families += [GaugeMetricFamily(f"llamacpp:{name}", text, value=value) for name, text, value in gauges]

        class Snapshot:
            def collect(self) -> list:
                return families
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Snapshot())
        return generate_latest(registry)
