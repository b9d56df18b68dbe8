"""Engine statistics: a recorder the scheduler alone writes, and frozen
snapshots anyone may read. Latencies keep a bounded window of recent
observations plus an all-time count and sum."""

from __future__ import annotations

from collections import Counter, deque

import attrs

from trioserve.state.prefix_cache import PrefixStats

WINDOW = 2048
# Histogram bucket upper bounds, seconds (Prometheus adds +Inf).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@attrs.frozen
class Latency:
    count: int
    total_s: float
    recent: tuple[float, ...]
    buckets: tuple[int, ...] = ()  # cumulative counts for each of BUCKETS

    @property
    def mean_s(self) -> float | None:
        return self.total_s / self.count if self.count else None


@attrs.frozen
class EngineStats:
    """kv_blocks_used counts blocks held by requests; blocks only the prefix
    cache holds are reported in ``prefix.idle_blocks``."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    block_size: int
    steps: int
    prompt_tokens: int  # prompt tokens computed (prefilled)
    generated_tokens: int
    finished: tuple[tuple[str, int], ...]  # (finish_reason, count)
    queue_wait: Latency
    ttft: Latency
    inter_token: Latency
    end_to_end: Latency
    dead: str | None = None
    last_batch: int = 0  # rows of the most recent step
    prefix: PrefixStats | None = None  # None when the prefix cache is off
    draft_tokens: int = 0  # speculative draft tokens checked
    draft_accepted: int = 0  # of them, kept (the model generated them)

    def finished_count(self, reason: str) -> int:
        return dict(self.finished).get(reason, 0)


class _Series:
    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.bucket_counts = [0] * len(BUCKETS)

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.recent.append(value)
        for i, bound in enumerate(BUCKETS):
            if value <= bound:
                self.bucket_counts[i] += 1
                break

    def freeze(self) -> Latency:
        cumulative, running = [], 0
        for n in self.bucket_counts:
            running += n
            cumulative.append(running)
        return Latency(self.count, self.total, tuple(self.recent), tuple(cumulative))


class StatsRecorder:
    def __init__(self) -> None:
        self.steps = 0
        self.last_batch = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.draft_tokens = 0
        self.draft_accepted = 0
        self.finished: Counter[str] = Counter()
        self.queue_wait = _Series()
        self.ttft = _Series()
        self.inter_token = _Series()
        self.end_to_end = _Series()
        self.dead: str | None = None

    def snapshot(
        self, *, running: int, waiting: int, used: int, total: int, block_size: int, prefix: PrefixStats | None = None
    ) -> EngineStats:
        return EngineStats(
            running=running,
            waiting=waiting,
            kv_blocks_used=used,
            kv_blocks_total=total,
            block_size=block_size,
            steps=self.steps,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            finished=tuple(sorted(self.finished.items())),
            queue_wait=self.queue_wait.freeze(),
            ttft=self.ttft.freeze(),
            inter_token=self.inter_token.freeze(),
            end_to_end=self.end_to_end.freeze(),
            dead=self.dead,
            last_batch=self.last_batch,
            prefix=prefix,
            draft_tokens=self.draft_tokens,
            draft_accepted=self.draft_accepted,
        )
