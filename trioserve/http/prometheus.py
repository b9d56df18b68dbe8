"""Engine statistics in Prometheus' text exposition format, `trioserve_`
names: latency histograms, counters of requests by outcome and of tokens,
gauges of what is in flight. Written by hand from a frozen snapshot; the
tests parse it with prometheus-client's own parser."""

from __future__ import annotations

from trioserve.state.stats import BUCKETS, EngineStats, Latency

OUTCOMES = ("stop", "length", "cancelled", "error")


def _histogram(lines: list[str], name: str, help_text: str, series: Latency) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} histogram")
    for bound, count in zip(BUCKETS, series.buckets or (0,) * len(BUCKETS)):
        lines.append(f'{name}_bucket{{le="{bound}"}} {count}')
    lines.append(f'{name}_bucket{{le="+Inf"}} {series.count}')
    lines.append(f"{name}_sum {series.total_s}")
    lines.append(f"{name}_count {series.count}")


def _single(lines: list[str], kind: str, name: str, help_text: str, value: float) -> None:
    # In the text format a counter's HELP and TYPE lines carry the _total name.
    sample = f"{name}_total" if kind == "counter" else name
    lines.append(f"# HELP {sample} {help_text}")
    lines.append(f"# TYPE {sample} {kind}")
    lines.append(f"{sample} {value}")


def render(stats: EngineStats, model: str, *, batch_invariant: bool) -> str:
    lines: list[str] = []
    _histogram(lines, "trioserve_time_to_first_token_seconds", "Arrival to first generated token.", stats.ttft)
    _histogram(lines, "trioserve_inter_token_latency_seconds", "Time between consecutive tokens of a request.", stats.inter_token)
    _histogram(lines, "trioserve_e2e_request_latency_seconds", "Arrival to the final event.", stats.end_to_end)
    _histogram(lines, "trioserve_queue_wait_seconds", "Arrival to admission.", stats.queue_wait)
    lines.append("# HELP trioserve_requests_total Finished requests by outcome.")
    lines.append("# TYPE trioserve_requests_total counter")
    for outcome in OUTCOMES:
        lines.append(f'trioserve_requests_total{{outcome="{outcome}"}} {stats.finished_count(outcome)}')
    _single(lines, "counter", "trioserve_prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens)
    _single(lines, "counter", "trioserve_generation_tokens", "Tokens generated.", stats.generated_tokens)
    _single(lines, "counter", "trioserve_engine_steps", "Engine steps run.", stats.steps)
    _single(lines, "counter", "trioserve_spec_decode_draft_tokens", "Speculative draft tokens checked.", stats.draft_tokens)
    _single(lines, "counter", "trioserve_spec_decode_accepted_tokens", "Speculative draft tokens kept.", stats.draft_accepted)
    _single(lines, "gauge", "trioserve_requests_running", "Requests admitted and not finished (in flight).", stats.running)
    _single(lines, "gauge", "trioserve_requests_waiting", "Requests waiting for admission.", stats.waiting)
    _single(lines, "gauge", "trioserve_batch_size", "Rows of the last engine step.", stats.last_batch)
    usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
    _single(lines, "gauge", "trioserve_kv_cache_usage_ratio", "Fraction of KV blocks in use.", usage)
    _single(lines, "gauge", "trioserve_kv_cache_blocks_used", "KV blocks in use.", stats.kv_blocks_used)
    _single(lines, "gauge", "trioserve_kv_cache_blocks_total", "KV blocks in the pool.", stats.kv_blocks_total)
    if stats.prefix is not None:
        p = stats.prefix
        _single(lines, "counter", "trioserve_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.", p.query_tokens)
        _single(lines, "counter", "trioserve_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", p.hit_tokens)
        _single(lines, "counter", "trioserve_prefix_cache_registered_tokens", "Tokens added to the prefix cache.", p.registered_tokens)
        _single(lines, "counter", "trioserve_prefix_cache_evictions", "Cached blocks evicted.", p.evictions)
        _single(lines, "gauge", "trioserve_prefix_cache_blocks", "Blocks the prefix cache holds.", p.cached_blocks)
        _single(lines, "gauge", "trioserve_session_kv_blocks", "Cached blocks that sessions keep pinned.", p.pinned_blocks)
        _single(lines, "counter", "trioserve_session_kv_evictions", "Times a session's kept KV was let go to make room.", p.pin_evictions)
    _single(lines, "gauge", "trioserve_batch_invariant", "1 when outputs never depend on what shares a step (--batch-invariant).", int(batch_invariant))
    lines.append("# HELP trioserve_model_info The model this server serves.")
    lines.append("# TYPE trioserve_model_info gauge")
    lines.append(f'trioserve_model_info{{model="{model}"}} 1')
    return "\n".join(lines) + "\n"
