"""The scheduler actor: a thin trio shell around the EngineCore, which makes
every decision (core/engine_core.py).

It runs two tasks over one core. `intake` answers the inbox at once
(accepting or refusing submissions) even while a step is running; a
consumer that leaves says so through `leave`, which never blocks. `steps`
loops: ask the core for the next plan; send it to the worker, whose
step result comes back here; hand the
result to the core; publish what it returns. Every call into the core
carries the time read here, and every such call is the one boundary a
recording sees (core/trace.py).

Publishing never blocks: each request's event channel holds max_tokens + 3
events. A request whose consumer left (`leave`, called as its generation
closes, or its event channel found closed when publishing) is cancelled;
neither needs room in the inbox, so a cancellation cannot be lost."""

from __future__ import annotations

import trio

from trioserve.actors.messages import SchedulerMessage, StepRequest, Submit, deliver
from trioserve.core.engine_core import EngineCore
from trioserve.errors import EngineClosed, sole_error
from trioserve.state.stats import EngineStats
from trioserve.types import Event, FinalEvent, StepResult


class Scheduler:
    """The actor's state. Only its own two tasks, `settle` and `leave`
    (called from other tasks on the same event loop, never blocking) touch
    the core;
    others read `snapshot()`, a frozen record of the statistics. It is made
    when first asked for after a change (the core's latency windows are
    thousands of values), so a step with no reader pays nothing for it, and
    readers between two changes share one record."""

    def __init__(self, core: EngineCore, worker: trio.MemorySendChannel[StepRequest], clock=trio.current_time) -> None:
        self.core = core  # an EngineCore, or a core/trace.py Recording of one
        self.worker = worker
        self.clock = clock
        self.channels: dict[str, trio.MemorySendChannel[Event]] = {}
        self.wake = trio.Event()
        self._snapshot: EngineStats | None = None  # None: changed since the last one was made
        self._stop_cause: str | None = None  # `stop` was asked: end everything at the top of the loop

    # -- intake ------------------------------------------------------------
    async def intake(self, inbox: trio.MemoryReceiveChannel[SchedulerMessage]) -> None:
        """Answer the inbox until it closes or the engine stops. Submissions
        still queued then are refused, so no caller waits for a reply that
        will never come."""
        try:
            async for message in inbox:
                self._submit(message)
                self.wake.set()
        finally:
            _refuse_queued(inbox)
            inbox.close()

    def _submit(self, message: Submit) -> None:
        refusal = self.core.submit(message.request_id, message.request, self.clock())
        if refusal is not None:
            deliver(message.reply, refusal)
            message.events.close()
            return
        self.channels[message.request_id] = message.events
        if not deliver(message.reply, None):
            self.core.cancel(message.request_id, self.clock())
        self._refresh()

    def settle(self, owner: str, order: str, request_id: str | None = None) -> None:
        """An owner's order about retained KV ("commit", "cancel" or
        "forget"); the core applies it before it next admits anything."""
        self.core.settle(owner, order, request_id, self.clock())
        self.wake.set()

    def stop(self, cause: str) -> None:
        """End every request with an error event saying ``cause`` and refuse
        new ones (the engine is going away: its model is unloaded). Applied
        at the top of the next iteration, after the step in flight."""
        self._stop_cause = cause
        self.wake.set()

    def fail_adapter(self, adapter: str, cause: str) -> int:
        """End every request of LoRA adapter ``adapter`` with an error
        event saying ``cause`` (at the next plan); how many there were."""
        ids = self.core.requests_of(adapter)
        for request_id in ids:
            self.core.cancel(request_id, self.clock(), cause)
        if ids:
            self.wake.set()
        return len(ids)

    def leave(self, request_id: str) -> None:
        """The consumer of ``request_id``'s events left before its end:
        the core cancels it (dropped from the next plan on). Nothing for a
        request not (or no longer) running."""
        if request_id in self.channels:
            self.core.cancel(request_id, self.clock())
            self.wake.set()

    # -- the loop ----------------------------------------------------------
    async def steps(self) -> None:
        while True:
            self.wake = trio.Event()
            if self._stop_cause is not None:
                cause, self._stop_cause = self._stop_cause, None
                self.die(cause)
            events, plan = self.core.plan(self.clock())
            self._publish(events)
            self._refresh()
            if plan is None:
                await self.wake.wait()
                continue
            result = await self._run(plan)
            self._publish(self.core.result(result, self.clock()))
            self._refresh()

    async def _run(self, plan) -> StepResult:
        send, receive = trio.open_memory_channel[StepResult](1)
        async with receive:
            await self.worker.send(StepRequest(plan, send))
            return await receive.receive()

    def die(self, cause: str) -> None:
        self._publish(self.core.die(cause, self.clock()))
        self._refresh()

    def kill(self, cause: str) -> None:
        """The engine is dead of a fault outside a step (an actor that
        failed): as `die`, unless it is dead already (the first cause
        stays); where the core's state is too broken even for that, it is
        marked dead anyway, so new work is refused. Never raises."""
        if self.core.stats.dead is not None:
            return
        try:
            self.die(cause)
        except Exception:  # noqa: BLE001 - state may be broken; refusing new work still matters
            self.core.stats.dead = cause
            self._refresh()

    # -- publishing ----------------------------------------------------------
    def _publish(self, events: list[Event]) -> None:
        for event in events:
            channel = self.channels.get(event.request_id)
            if channel is None:
                continue
            if isinstance(event, FinalEvent):
                deliver(channel, event)
                del self.channels[event.request_id]
                channel.close()
            elif not deliver(channel, event):
                self.core.cancel(event.request_id, self.clock())  # the consumer is gone

    def _refresh(self) -> None:
        self._snapshot = None

    def snapshot(self) -> EngineStats:
        """The engine's statistics as of the last change."""
        if self._snapshot is None:
            self._snapshot = self.core.snapshot()
        return self._snapshot


def _refuse_queued(inbox: trio.MemoryReceiveChannel[SchedulerMessage]) -> None:
    while True:
        try:
            message = inbox.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return
        if isinstance(message, Submit):
            deliver(message.reply, EngineClosed("the engine is shut down"))
            message.events.close()


async def run_scheduler(scheduler: Scheduler, inbox: trio.MemoryReceiveChannel[SchedulerMessage], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run intake and the step loop until cancelled (engine shutdown), when
    consumers see their event channels close. A bug that escapes the step
    loop kills the engine like a fatal step: every request in flight gets an
    error, statistics().dead says why, and intake goes on refusing new work.
    One that escapes intake does the same, then ends the actor (raised)."""
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scheduler.intake, inbox)
            task_status.started()
            try:
                await scheduler.steps()
            except Exception as exc:  # noqa: BLE001 - reported through dead, never lost
                scheduler.kill(f"internal error in the scheduler: {type(exc).__name__}: {exc}")
                await trio.sleep_forever()
    except Exception as exc:
        # Intake failed: its requests get their error events before their channels close below.
        leaf = sole_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
        scheduler.kill(f"internal error in the scheduler: {type(leaf).__name__}: {leaf}")
        raise
    finally:
        # After both tasks are done: intake may accept a submission in the
        # same tick the loop is cancelled, and its consumer must still see
        # its stream end.
        for channel in scheduler.channels.values():
            channel.close()
