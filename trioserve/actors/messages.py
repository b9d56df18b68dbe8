"""The messages the actors exchange, as frozen attrs records. Reply paths
travel inside messages. The records they carry (requests, plans, results,
events) are the shared plain types of trioserve.types."""

from __future__ import annotations

import attrs
import trio

from trioserve.types import Event, GenerateRequest, StepPlan, StepResult


# -- scheduler inbox -----------------------------------------------------------
@attrs.frozen
class Submit:
    request_id: str
    request: GenerateRequest
    events: trio.MemorySendChannel[Event]  # bounded by max_tokens + 3: publishing never blocks
    reply: trio.MemorySendChannel[BaseException | None]  # one message: None (accepted) or the refusal


SchedulerMessage = Submit  # a consumer that leaves tells the scheduler directly (Scheduler.leave)


# -- worker inbox --------------------------------------------------------------
@attrs.frozen
class StepRequest:
    """Run ``plan`` (models/step_runner.py); its StepResult goes to ``reply``."""

    plan: StepPlan
    reply: trio.MemorySendChannel[StepResult]


def deliver(channel: trio.MemorySendChannel, message) -> bool:
    """Hand ``message`` to a reply channel without waiting. False when the
    asker stopped waiting (its end is closed): there is no one to tell."""
    try:
        channel.send_nowait(message)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        return False
    return True
