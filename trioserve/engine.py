"""The in-process engine API.

    async with open_engine(config) as engine:
        async for event in engine.generate(GenerateRequest(prompt_ids, params)):
            ...

`open_engine` loads the model (in a thread, with progress), sizes the KV pool
from the byte budget, and starts the worker, sampler and scheduler actors in
its own nursery. Leaving the block cancels them all."""

from __future__ import annotations

import contextlib
import functools
import secrets
import sys
import traceback
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import torch
import trio

from trioserve.actors.device import DeviceThread, open_device_thread, release_openmp_threads
from trioserve.actors.messages import SchedulerMessage, StepRequest, Submit
from trioserve.actors.scheduler import Scheduler, run_scheduler
from trioserve.actors.worker import run_worker
from trioserve.config import EngineConfig
from trioserve.core.engine_core import CoreSettings, check_request, new_core
from trioserve.core.trace import Recording, TraceWriter, header, new_trace_path
from trioserve.errors import EngineClosed, RequestError
from trioserve.kernels.cpu import resolve_dtype, resolve_kv_dtype
from trioserve.models.build import build_model, is_encoder
from trioserve.models.checkpoint import Checkpoint, Progress, checkpoint_digest, load_checkpoint
from trioserve.models.compute import compute_card, cpu_class
from trioserve.models.guided import GuideCompiler
from trioserve.models.decoder import DecoderModel
from trioserve.models.sampling import new_seed
from trioserve.models.step_runner import StepRunner, thread_governor
from trioserve.models.config import ModelConfig
from trioserve.models.family import family_of
from trioserve.models.tokenizer import Tokenizer
from trioserve.state.kv_pool import blocks_for_budget, blocks_needed
from trioserve.state.stats import EngineStats
from trioserve.types import Event, FinalEvent, GenerateRequest, SamplingParams

class Engine:
    """A handle on running actors: submit requests, read statistics."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        max_model_len: int,
        scheduler: Scheduler,
        inbox: trio.MemorySendChannel[SchedulerMessage],
        guides: GuideCompiler,
        hidden_size: int = 0,
        activations: str = "bf16",
        model_config: ModelConfig | None = None,
    ):
        self.config = config
        self.model_config = model_config  # the checkpoint's settings: its family, pooling, reranking prompt
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.hidden_size = hidden_size  # the length of the vectors `embed` gives
        self._scheduler = scheduler
        self._inbox = inbox
        self.guides = guides  # compiles output constraints (guided decoding)
        self.trace_path: Path | None = None  # the trace being written (config.record_dir), if any
        self.activations = activations  # what the 4-bit projections take: config.activations, auto resolved
        # How the model computes (`compute_card`): set by open_engine; the model card and /metrics show it.
        self.compute: dict[str, object] = {}
        self.adapters: AdapterSlots | None = None  # its model's LoRA adapters: set by open_engine

    def fail_adapter(self, key: str, cause: str) -> int:
        """End every request of LoRA adapter ``key`` with an error event
        saying ``cause``; how many there were."""
        return self._scheduler.fail_adapter(key, cause)

    def stop(self, cause: str) -> None:
        """End every request in flight with an error event saying ``cause``,
        after the step now running, and refuse new ones from then on."""
        self._scheduler.stop(cause)

    def statistics(self) -> EngineStats:
        """A frozen snapshot of the engine's statistics, made now."""
        return self._scheduler.snapshot()

    def settle_retained(self, owner: str, request_id: str, *, commit: bool) -> None:
        """An owner's turn (request ``request_id``, submitted with
        retain=owner) ended: ``commit`` makes the KV held for it the
        owner's, in place of what it kept before; otherwise that KV is let
        go, now or when the request ends. Takes effect before the scheduler
        admits anything further."""
        self._scheduler.settle(owner, "commit" if commit else "cancel", request_id)

    def forget_retained(self, owner: str) -> None:
        """Let go of everything kept for ``owner`` (the session ended)."""
        self._scheduler.settle(owner, "forget")

    def open_generation(self, request: GenerateRequest) -> Generation:
        """Submit ``request`` on entering the returned async context; once
        the scheduler accepted it, the context gives its events (ending with
        one FinalEvent) as an async iterator.

        Raises on entry: RequestError / RequestTooLarge (bad or impossible
        request), QueueFull, EngineDead, EngineClosed. Leaving the block
        before the FinalEvent, or being cancelled, cancels the request; the
        scheduler frees its blocks within one step. The context's `close()`
        does the same without awaiting anything, for callers that cannot
        (a response body that never started)."""
        if request.pooling is None and self.is_encoder:
            raise RequestError(f"model: {self.encoder_routes()}, not generation", field="model")
        return Generation(self, request)

    def encoder_routes(self) -> str:
        """What an encoder serves, in words, for the 400s of what it does not."""
        if self.is_cross_encoder:
            return f"this model is a cross-encoder ({self.model_config.architecture}): it scores pairs (/v1/rerank and /v1/score)"
        return (
            f"this model is an encoder ({self.model_config.architecture}): it serves embeddings "
            "(/v1/embeddings, and /v1/rerank and /v1/score by their cosine)"
        )

    @property
    def embedding_pooling(self) -> str:
        """How `embed` pools: --embedding-pooling, where `auto` is what the
        model file declares (mean or last), else mean."""
        chosen = self.config.embedding_pooling
        if self.is_cross_encoder:  # its head's relevance output on the first token, as a value
            return "score"
        if chosen != "auto":
            return chosen
        declared = self.model_config.pooling if self.model_config is not None else None
        if declared == "cls" and self.is_encoder:  # the first token's state ([CLS]); an encoder's input runs whole
            return "first"
        return declared if declared in ("mean", "last") else "mean"

    @property
    def is_cross_encoder(self) -> bool:
        """An encoder with a relevance head (bge-reranker, ms-marco MiniLM): it scores pairs alone."""
        return self.is_encoder and self.model_config.num_labels > 0

    @property
    def is_encoder(self) -> bool:
        """An encoder model (models/bert.py): embeddings only, each input whole in one step."""
        return self.model_config is not None and family_of(self.model_config.architecture).kind == "encoder"

    @property
    def is_reranker(self) -> bool:
        """The model file says it is a reranker (GGUF pooling_type rank)."""
        return self.model_config is not None and self.model_config.pooling == "rank"

    async def embed(self, prompt_ids, *, request_id: str | None = None, adapter: str | None = None) -> FinalEvent:
        """Embed one prompt: an embedding request (GenerateRequest.pooling,
        config.embedding_pooling) through the same scheduler as generation.
        Returns its FinalEvent: finish_reason "stop" with the vector in
        ``embedding``, or "error" with the cause. Raises on submission as
        `open_generation` does; cancelled, the request is cancelled and its
        blocks freed within one step."""
        request = GenerateRequest(
            prompt_ids, SamplingParams(max_tokens=1, temperature=0.0, seed=0), request_id=request_id, pooling=self.embedding_pooling,
            adapter=adapter,
        )
        final = None
        async with self.open_generation(request) as events:
            async for event in events:  # the one event is the FinalEvent
                final = event
        assert isinstance(final, FinalEvent), final
        return final

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """`open_generation` as one async generator: submit, then yield every
        event. Leaving the loop early cancels the request (promptly when the
        generator is closed, e.g. with contextlib.aclosing)."""
        async with self.open_generation(request) as events:
            async for event in events:
                yield event


class AdapterSlots:
    """The LoRA adapters resident in an engine's model, put there and taken
    out on its device thread, between steps (the model reads them there)."""

    def __init__(self, model: DecoderModel, device: DeviceThread, config: EngineConfig) -> None:
        self._model = model
        self._device = device
        self.max_rank = config.max_lora_rank
        model.lora.capacity = config.max_loras

    @property
    def model_config(self):
        """The model's shapes, which an adapter must match."""
        return self._model.config

    @property
    def loaded(self) -> int:
        return len(self._model.lora)

    @property
    def capacity(self) -> int:
        return self._model.lora.capacity

    async def add(self, key: str, adapter) -> None:
        """Make ``adapter`` resident under ``key`` (models/lora_set.py); ValueError when full."""
        await self._device.run(self._model.lora.add, key, adapter)

    async def remove(self, key: str) -> None:
        """Let go of ``key``'s adapter; no request of it may be running."""
        await self._device.run(self._model.lora.remove, key)


class Generation:
    """One request's submission and the end of it (`Engine.open_generation`).

    The edge of the engine: a request without a seed gets a fresh one
    here, so everything past this point is deterministic. Its cleanup is
    synchronous and never blocks: it tells the scheduler it left
    (`Scheduler.leave`), then closes the event channel."""

    def __init__(self, engine: Engine, request: GenerateRequest) -> None:
        check_request(request, engine.tokenizer.vocab_size)
        if request.params.seed is None:
            request = attrs.evolve(request, params=attrs.evolve(request.params, seed=new_seed()))
        self.request = request
        self.request_id = request.request_id or f"req-{secrets.token_hex(8)}"
        self._inbox = engine._inbox
        self._scheduler = engine._scheduler
        events_send, events = trio.open_memory_channel[Event](request.params.max_tokens + 3)  # tokens, a prompt event, the final, one spare
        self._events_send = events_send
        self._reply_send, self._reply = trio.open_memory_channel[BaseException | None](1)
        self.stream = _EventStream(events)

    async def __aenter__(self) -> _EventStream:
        return await self.submit()

    async def submit(self) -> _EventStream:
        """Submit the request and wait for the scheduler's answer: its
        events, or the refusal raised (everything let go then). Once
        submitted, `close()` (or leaving the context) must end it: for a
        caller that hands the events on, e.g. to a response body that will
        close it in a ``finally``."""
        try:
            try:
                await self._inbox.send(Submit(self.request_id, self.request, self._events_send, self._reply_send))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                raise EngineClosed("the engine is shut down") from None
            try:
                outcome = await self._reply.receive()
            except trio.EndOfChannel:
                raise EngineClosed("the engine is shut down") from None
        except BaseException:
            self._events_send.close()  # never delivered: nobody else will close it
            self.close()
            raise
        if outcome is not None:
            self.stream.finished = True  # refused: there is nothing to cancel
            self.close()
            raise outcome
        return self.stream

    async def __aexit__(self, *exc_info) -> bool:
        self.close()
        return False

    def close(self) -> None:
        """Stop: cancel the request if it has not ended, and let go of its
        channels. Idempotent; never blocks."""
        if not self.stream.finished and not self.stream.closed:
            self._scheduler.leave(self.request_id)
        self.stream.close()
        self._reply.close()


class _EventStream:
    """A request's events, up to and including its FinalEvent."""

    def __init__(self, channel: trio.MemoryReceiveChannel[Event]) -> None:
        self._channel = channel
        self.finished = False
        self.closed = False

    def close(self) -> None:
        """Stop receiving: the scheduler cancels the request (if it has not
        ended) at its next iteration."""
        self.closed = True
        self._channel.close()

    def __aiter__(self) -> _EventStream:
        return self

    async def __anext__(self) -> Event:
        if self.finished:
            raise StopAsyncIteration
        try:
            event = await self._channel.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise EngineClosed("the engine shut down before the request finished") from None
        if isinstance(event, FinalEvent):
            self.finished = True
        return event


# The kinds of torch device an engine runs on (--device; a load's "device" option).
RUNNABLE_DEVICES = ("cpu", "cuda")


def device_problem(name: object) -> str | None:
    """What keeps ``name`` from being a device a model runs on here, or
    None: a torch device of a kind the engine runs (cpu, cuda[:N]) that
    this machine has. A "meta" tensor holds no data, so a model there
    cannot compute anything."""
    if not isinstance(name, str):
        return f"expected a string (one of: {', '.join(RUNNABLE_DEVICES)}), got {type(name).__name__}"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return f"{name!r} is not a torch device (one of: {', '.join(RUNNABLE_DEVICES)}, or cuda:N)"
    if device.type not in RUNNABLE_DEVICES:
        return f"{name!r} cannot run a model (one of: {', '.join(RUNNABLE_DEVICES)}, or cuda:N)"
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return f"{name!r}: this machine has no CUDA device torch can use"
        if device.index is not None and device.index >= count:
            return f"{name!r}: this machine has {count} CUDA device{'s' if count > 1 else ''} (cuda:0 to cuda:{count - 1})"
    return None


# The share of a GPU's free memory (after the weights are loaded) the KV
# pool may take at most; the rest is left for activations and the allocator.
GPU_KV_SHARE = 0.9


def kv_budget(requested: int, device: torch.device, free_bytes: int | None = None) -> int:
    """The KV pool's bytes: ``requested`` (--kv-cache-bytes), but on a GPU
    no more than GPU_KV_SHARE of its free memory (``free_bytes``, read from
    the device when not given)."""
    if device.type != "cuda":
        return requested
    if free_bytes is None:
        free_bytes, _total = torch.cuda.mem_get_info(device)
    return min(requested, int(free_bytes * GPU_KV_SHARE))


@contextlib.asynccontextmanager
async def open_engine(
    config: EngineConfig,
    *,
    checkpoint: Checkpoint | None = None,
    model: DecoderModel | None = None,
    progress: Progress | None = None,
    build_progress: Progress | None = None,
) -> AsyncIterator[Engine]:
    """Start an engine. ``checkpoint`` skips loading ``config.model``;
    ``model`` (built from that checkpoint) skips building the model.
    ``progress`` is told of the tensors loaded, ``build_progress`` of the
    layers built. A device no model can run on is refused first
    (RequestError naming ``device``)."""
    problem = device_problem(config.device)
    if problem is not None:
        raise RequestError(f"device: {problem}", field="device")
    async with open_device_thread() as device:
        if checkpoint is None:
            checkpoint = await device.run(lambda: load_checkpoint(config.model, dtype=resolve_dtype(config.dtype, config.device), progress=progress))
        if model is None:
            model = await device.run(
                lambda: build_model(
                    checkpoint, use_int4=config.use_int4, device=config.device, batch_invariant=config.batch_invariant,
                    kernels=config.kernels, activations=config.activations, kv_dtype=resolve_kv_dtype(config.kv_cache_dtype),
                    progress=build_progress, max_model_len=config.max_model_len,  # RoPE tables for what is served, not what the file says
                )
            )
        elif model.batch_invariant != config.batch_invariant:
            raise ValueError(f"the model was built with batch_invariant={model.batch_invariant}, the config says {config.batch_invariant}")
        # Whatever torch work this thread did (a checkpoint loaded by the
        # caller) left OpenMP helpers that would slow the device thread's.
        release_openmp_threads()
        async with _open_engine(config, checkpoint, model, device) as engine:
            yield engine


@contextlib.asynccontextmanager
async def _open_engine(config: EngineConfig, checkpoint: Checkpoint, model: DecoderModel, device: DeviceThread) -> AsyncIterator[Engine]:
    max_len = min(config.max_model_len or checkpoint.config.max_position, checkpoint.config.max_position)
    encoder = is_encoder(checkpoint)
    if encoder:
        # An encoder's input runs whole in one step (bidirectional attention), so no longer than a
        # step's budget; it keeps no KV: its blocks are a count of what runs, one full input each.
        max_len = min(max_len, config.prefill_budget)
        budget = num_blocks = config.max_num_seqs * blocks_needed(max_len, config.block_size)
    else:
        budget = await device.run(kv_budget, config.kv_cache_bytes, model.device)
        num_blocks = blocks_for_budget(budget, model.kv_bytes_per_token(), config.block_size)
    if num_blocks < 1:
        where = "" if budget == config.kv_cache_bytes else f", or the {budget} bytes {model.device} has free for it"
        raise RequestError(
            f"kv_cache_bytes ({config.kv_cache_bytes}{where}) is less than one block "
            f"({model.kv_bytes_per_token() * config.block_size} bytes)",
            field="kv_cache_bytes",
        )
    cache = await device.run(functools.partial(model.new_kv_cache, num_blocks, config.block_size, huge_pages=config.kv_huge_pages))
    settings = CoreSettings(
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_len,
        prefill_budget=config.prefill_budget,
        max_queue=config.max_queue,
        retry_after_s=config.retry_after_s,
        prefix_cache=config.prefix_cache and not encoder,  # an encoder keeps nothing to share
        prefix_cache_max_blocks=prefix_cache_blocks(config, model.kv_bytes_per_token()) if config.prefix_cache and not encoder else None,
        prefix_cache_idle_s=config.prefix_cache_idle_s,
        # Batch-invariant bf16 computes a generated token's K/V on other weights than a prompt
        # token's, so it must not stand in for one; with int8 activations both take one path.
        share_generated_kv=not config.batch_invariant or model.kernels.activations == "int8",
        draft_tokens=config.draft_tokens,
        max_step_s=config.max_step_ms / 1000,
        whole_prompts=encoder,
    )
    core = new_core(settings, checkpoint.tokenizer)
    writer = None
    if config.record_dir is not None:
        writer = await trio.to_thread.run_sync(_open_trace, config, checkpoint, settings, model)
        core = Recording(core, writer)
    worker_send, worker_recv = trio.open_memory_channel[StepRequest](1)
    inbox_send, inbox_recv = trio.open_memory_channel[SchedulerMessage](config.channel_size)
    guides = GuideCompiler(checkpoint.tokenizer)
    runner = StepRunner(model, cache, vocab_size=checkpoint.tokenizer.vocab_size, guides=guides, governor=thread_governor(model))
    scheduler = Scheduler(core, worker_send)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(_contained, scheduler, "worker", run_worker, runner, worker_recv, device)
            await nursery.start(_contained, scheduler, "scheduler", run_scheduler, scheduler, inbox_recv)
            engine = Engine(
                config, checkpoint.tokenizer, max_len, scheduler, inbox_send, guides, checkpoint.config.hidden_size, model.kernels.activations,
                checkpoint.config,
            )
            engine.trace_path = None if writer is None else writer.path
            engine.compute = compute_card(model)
            engine.adapters = AdapterSlots(model, device, config)
            try:
                yield engine
            finally:
                inbox_send.close()
                nursery.cancel_scope.cancel()
                # An Engine a caller still holds must not keep the model (its
                # weights) alive once the engine is gone.
                engine.adapters = None
    finally:
        if writer is not None:
            writer.close()  # however the engine ends; every line is flushed already


async def _contained(scheduler: Scheduler, name: str, actor, *args, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run one of the engine's actors. One that fails once started (a bug:
    a step's own faults are results, actors/worker.py) kills this engine
    only: every request in flight ends with an error event saying why,
    new ones are refused (EngineDead), and the engine stays up until it is
    closed (its model unloaded), never raising into the nursery above it."""
    started = False

    def started_now(value=None) -> None:
        nonlocal started
        started = True
        task_status.started(value)

    try:
        await actor(*args, task_status=_Started(started_now))
    except Exception as exc:
        if not started:
            raise  # the engine does not open: its caller says why
        cause = " ".join(f"the engine's {name} actor failed: {type(exc).__name__}: {exc}".split())
        print(f"trioserve: {cause}; the engine is dead", file=sys.stderr, flush=True)
        traceback.print_exception(exc, file=sys.stderr)
        scheduler.kill(cause)


class _Started:
    """A task_status passed on, which notes that the actor started."""

    def __init__(self, on_started) -> None:
        self._on_started = on_started

    def started(self, value=None) -> None:
        self._on_started(value)


def _open_trace(config: EngineConfig, checkpoint: Checkpoint, settings: CoreSettings, model: DecoderModel) -> TraceWriter:
    """A new trace file in config.record_dir, its header written (blocking:
    hashes the checkpoint), with the CPU class it runs on (`cpu_class`) and
    the activations the model runs (a model handed to the engine may not
    have the config's)."""
    activations, kv_dtype = model.kernels.activations, model.kv_dtype
    head = header(
        settings,
        checkpoint_path=str(checkpoint.path),
        digest=checkpoint_digest(checkpoint.path),
        # "auto" resolved: the dtype this machine chose (kernels/cpu.py), so
        # a replay elsewhere loads the weights as this run did.
        # And the activations the model runs, which replay rebuilds.
        engine={
            **attrs.asdict(config),
            "dtype": str(checkpoint.weights["model.embed_tokens.weight"].dtype).removeprefix("torch."),
            "activations": activations,
            "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        },
        vocab_size=checkpoint.tokenizer.vocab_size,
        cpu=cpu_class(model) if model.device.type == "cpu" else None,
    )
    return TraceWriter(new_trace_path(config.record_dir), head)


def prefix_cache_blocks(config: EngineConfig, kv_bytes_per_token: int) -> int | None:
    """The prefix cache's block limit: the fewer of its count and byte limits."""
    limits = []
    if config.prefix_cache_max_blocks is not None:
        limits.append(config.prefix_cache_max_blocks)
    if config.prefix_cache_max_bytes is not None:
        limits.append(config.prefix_cache_max_bytes // (kv_bytes_per_token * config.block_size))
    return min(limits) if limits else None
