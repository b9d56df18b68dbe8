"""Engine statistics in Prometheus' text exposition format, `trioserve_`
names: latency histograms, counters of requests by outcome and of tokens,
gauges of what is in flight; every sample labelled with its model
(``model="..."``), one set per served model. Written by hand from frozen
snapshots; the tests parse it with prometheus-client's own parser."""

from __future__ import annotations

from trioserve.state.stats import BUCKETS, EngineStats, Latency

OUTCOMES = ("stop", "length", "cancelled", "error")


class _Families:
    """Metric families in the order first met, each with its samples from
    every model: one HELP and TYPE line per family, then its samples."""

    def __init__(self) -> None:
        self.heads: dict[str, tuple[str, str]] = {}  # family name -> (kind, help)
        self.samples: dict[str, list[str]] = {}

    def add(self, family: str, kind: str, help_text: str, sample: str, labels: dict[str, str], value: float) -> None:
        if family not in self.heads:
            self.heads[family] = (kind, help_text)
            self.samples[family] = []
        text = ",".join(f'{key}="{_escape(val)}"' for key, val in labels.items())
        self.samples[family].append(f"{sample}{{{text}}} {value}")

    def text(self) -> str:
        lines: list[str] = []
        for family, (kind, help_text) in self.heads.items():
            lines.append(f"# HELP {family} {help_text}")
            lines.append(f"# TYPE {family} {kind}")
            lines.extend(self.samples[family])
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _histogram(out: _Families, model: str, name: str, help_text: str, series: Latency) -> None:
    for bound, count in zip(BUCKETS, series.buckets or (0,) * len(BUCKETS)):
        out.add(name, "histogram", help_text, f"{name}_bucket", {"model": model, "le": str(bound)}, count)
    out.add(name, "histogram", help_text, f"{name}_bucket", {"model": model, "le": "+Inf"}, series.count)
    out.add(name, "histogram", help_text, f"{name}_sum", {"model": model}, series.total_s)
    out.add(name, "histogram", help_text, f"{name}_count", {"model": model}, series.count)


def _single(out: _Families, model: str, kind: str, name: str, help_text: str, value: float) -> None:
    # In the text format a counter's HELP and TYPE lines carry the _total name.
    sample = f"{name}_total" if kind == "counter" else name
    out.add(sample, kind, help_text, sample, {"model": model}, value)


def render(models: list[tuple[str, EngineStats, bool]]) -> str:
    """Every model's statistics, each sample labelled with its model:
    ``models`` holds (name, statistics, batch invariant) of each."""
    out = _Families()
    for model, stats, batch_invariant in models:
        _model_metrics(out, model, stats, batch_invariant)
    return out.text()


def _model_metrics(out: _Families, model: str, stats: EngineStats, batch_invariant: bool) -> None:
    def single(kind: str, name: str, help_text: str, value: float) -> None:
        _single(out, model, kind, name, help_text, value)

    _histogram(out, model, "trioserve_time_to_first_token_seconds", "Arrival to first generated token.", stats.ttft)
    _histogram(out, model, "trioserve_inter_token_latency_seconds", "Time between consecutive tokens of a request.", stats.inter_token)
    _histogram(out, model, "trioserve_e2e_request_latency_seconds", "Arrival to the final event.", stats.end_to_end)
    _histogram(out, model, "trioserve_queue_wait_seconds", "Arrival to admission.", stats.queue_wait)
    for outcome in OUTCOMES:
        out.add("trioserve_requests_total", "counter", "Finished requests by outcome.", "trioserve_requests_total",
                {"model": model, "outcome": outcome}, stats.finished_count(outcome))  # fmt: skip
    single("counter", "trioserve_prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens)
    single("counter", "trioserve_generation_tokens", "Tokens generated.", stats.generated_tokens)
    single("counter", "trioserve_engine_steps", "Engine steps run.", stats.steps)
    single("counter", "trioserve_spec_decode_draft_tokens", "Speculative draft tokens checked.", stats.draft_tokens)
    single("counter", "trioserve_spec_decode_accepted_tokens", "Speculative draft tokens kept.", stats.draft_accepted)
    single("gauge", "trioserve_requests_running", "Requests admitted and not finished (in flight).", stats.running)
    single("gauge", "trioserve_requests_waiting", "Requests waiting for admission.", stats.waiting)
    single("gauge", "trioserve_batch_size", "Rows of the last engine step.", stats.last_batch)
    usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
    single("gauge", "trioserve_kv_cache_usage_ratio", "Fraction of KV blocks in use.", usage)
    single("gauge", "trioserve_kv_cache_blocks_used", "KV blocks in use.", stats.kv_blocks_used)
    single("gauge", "trioserve_kv_cache_blocks_total", "KV blocks in the pool.", stats.kv_blocks_total)
    if stats.prefix is not None:
        p = stats.prefix
        single("counter", "trioserve_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.", p.query_tokens)
        single("counter", "trioserve_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", p.hit_tokens)
        single("counter", "trioserve_prefix_cache_registered_tokens", "Tokens added to the prefix cache.", p.registered_tokens)
        single("counter", "trioserve_prefix_cache_evictions", "Cached blocks evicted.", p.evictions)
        single("gauge", "trioserve_prefix_cache_blocks", "Blocks the prefix cache holds.", p.cached_blocks)
        single("gauge", "trioserve_session_kv_blocks", "Cached blocks that sessions keep pinned.", p.pinned_blocks)
        single("counter", "trioserve_session_kv_evictions", "Times a session's kept KV was let go to make room.", p.pin_evictions)
    single("gauge", "trioserve_batch_invariant", "1 when outputs never depend on what shares a step (--batch-invariant).", int(batch_invariant))
    single("gauge", "trioserve_model_info", "A model this server serves.", 1)
