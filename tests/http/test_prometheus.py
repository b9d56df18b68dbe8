"""The Prometheus text rendering parses with prometheus-client's parser and
carries the snapshot's numbers, histograms included."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from trioserve.http.prometheus import render
from trioserve.state.stats import BUCKETS, StatsRecorder


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_render_parses_and_carries_the_numbers():
    rec = StatsRecorder()
    for value in (0.003, 0.2, 0.2, 7.0, 500.0):
        rec.ttft.add(value)
    rec.finished["stop"] += 3
    rec.finished["cancelled"] += 1
    rec.prompt_tokens, rec.generated_tokens, rec.last_batch = 120, 45, 7
    snap = rec.snapshot(running=2, waiting=5, used=30, total=120, block_size=16)
    fam = families(render([("tiny", snap, True)]))

    ttft = {(s.name, s.labels.get("le")): s.value for s in fam["trioserve_time_to_first_token_seconds"].samples}
    assert ttft[("trioserve_time_to_first_token_seconds_count", None)] == 5
    assert abs(ttft[("trioserve_time_to_first_token_seconds_sum", None)] - 507.403) < 1e-9
    # Cumulative buckets: 0.003 is under the first bound; 0.2 twice under 0.25; 7.0 under 10; 500 only in +Inf.
    assert ttft[("trioserve_time_to_first_token_seconds_bucket", str(BUCKETS[0]))] == 1
    assert ttft[("trioserve_time_to_first_token_seconds_bucket", "0.25")] == 3
    assert ttft[("trioserve_time_to_first_token_seconds_bucket", "10.0")] == 4
    assert ttft[("trioserve_time_to_first_token_seconds_bucket", "120.0")] == 4
    assert ttft[("trioserve_time_to_first_token_seconds_bucket", "+Inf")] == 5

    outcomes = {s.labels["outcome"]: s.value for s in fam["trioserve_requests"].samples}
    assert outcomes == {"stop": 3, "length": 0, "cancelled": 1, "error": 0}
    assert fam["trioserve_prompt_tokens"].samples[0].value == 120
    assert fam["trioserve_generation_tokens"].samples[0].value == 45
    assert fam["trioserve_requests_running"].samples[0].value == 2
    assert fam["trioserve_requests_waiting"].samples[0].value == 5
    assert fam["trioserve_batch_size"].samples[0].value == 7
    assert fam["trioserve_kv_cache_usage_ratio"].samples[0].value == 0.25
    assert fam["trioserve_model_info"].samples[0].labels == {"model": "tiny"}
    assert fam["trioserve_batch_invariant"].samples[0].value == 1


def test_empty_snapshot_renders_zero_histograms():
    snap = StatsRecorder().snapshot(running=0, waiting=0, used=0, total=10, block_size=16)
    fam = families(render([("m", snap, False)]))
    for name in ("trioserve_inter_token_latency_seconds", "trioserve_e2e_request_latency_seconds", "trioserve_queue_wait_seconds"):
        assert all(s.value == 0 for s in fam[name].samples)
    assert fam["trioserve_batch_invariant"].samples[0].value == 0


def test_every_sample_is_labelled_with_its_model():
    """Two models: one HELP/TYPE per family (the parser would refuse a
    repeat), each model's numbers under its own label."""
    busy, idle = StatsRecorder(), StatsRecorder()
    busy.prompt_tokens, busy.finished["stop"] = 40, 2
    busy.ttft.add(0.2)
    a = busy.snapshot(running=3, waiting=1, used=5, total=10, block_size=16)
    b = idle.snapshot(running=0, waiting=0, used=0, total=20, block_size=16)
    text = render([("chat", a, True), ('odd "name"', b, False)])
    assert text.count("# TYPE trioserve_prompt_tokens_total counter") == 1
    fam = families(text)
    for family in fam.values():
        assert {s.labels["model"] for s in family.samples} == {"chat", 'odd "name"'}, family.name
    by_model = lambda name: {s.labels["model"]: s.value for s in fam[name].samples}  # noqa: E731
    assert by_model("trioserve_prompt_tokens") == {"chat": 40, 'odd "name"': 0}
    assert by_model("trioserve_requests_running") == {"chat": 3, 'odd "name"': 0}
    assert by_model("trioserve_kv_cache_blocks_total") == {"chat": 10, 'odd "name"': 20}
    assert by_model("trioserve_batch_invariant") == {"chat": 1, 'odd "name"': 0}
    counts = {s.labels["model"]: s.value for s in fam["trioserve_time_to_first_token_seconds"].samples if s.name.endswith("_count")}
    assert counts == {"chat": 1, 'odd "name"': 0}
    stops = {s.labels["model"]: s.value for s in fam["trioserve_requests"].samples if s.labels["outcome"] == "stop"}
    assert stops == {"chat": 2, 'odd "name"': 0}
