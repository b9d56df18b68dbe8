"""The model registry: every model the server serves, each on an engine of
its own (scheduler, worker, KV pool), under one HTTP front.

A model's life, by its `state`:

    loading    its name is taken; nothing is routed to it yet
    ready      the request's ``model`` picks it
    dead       its engine stopped after a fault (a step that raised, or its
               actors ending on their own): its requests get 503
               engine_dead; it stays listed until an admin unloads it
    unloading  it takes no new requests; those in flight finish or are ended

A fault stays in its model: the engine's actors turn a step's exception
into the engine's death (actors/worker.py), and `Model.serve` keeps
anything that still escapes out of the registry's nursery, so the other
models, the shared routes and later loads go on.

`Registry.load` runs in phases: reserve the name (a second load of it is a
409), admit it against ``--memory-budget`` (a load that cannot fit is
refused with the numbers and leaves nothing behind), load it, one load at
a time, while every other model keeps serving, and publish it (one
assignment). A failed load frees the name and says why in one line. The
budget counts a model's weights file, its KV pool and its RoPE tables;
the tables' size needs the model's settings, read (off the event loop) as
its load begins, so a model that fits by its file and pool may still be
refused there, before anything of it is made.

`Registry.unload` stops routing to the model, waits up to ``timeout_s`` for
its requests in flight (each HTTP request holds the model from its route
until its last byte: `Registry.route`), ends those left with an error
event (`Engine.stop`), then stops the engine, whose memory goes with it."""

from __future__ import annotations

import functools
import gc
import json
import sys
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from trioserve.config import EngineConfig, ServerSettings
from trioserve.engine import Engine, open_engine
from trioserve.models.compute import describe_compute
from trioserve.errors import CheckpointError, RequestError, TrioserveError
from trioserve.http import openai
from trioserve.http.errors import HTTPError
from trioserve.http.in_flight import at_request_end
from trioserve.models.chat_template import ChatTemplate
from trioserve.models.checkpoint import Checkpoint
from trioserve.models.config import ModelConfig
from trioserve.models.lora import load_lora_adapter
from trioserve.models.output_parser import THINK_OPEN
from trioserve.progress import ProgressBar

LOAD_RETRY_AFTER_S = 5  # what a 503 for a model still loading tells the client to wait
STOP_GRACE_S = 10.0  # after an unload's error events, how long its requests get to send them


class Held:
    """Counts the HTTP requests that hold something (a model, an adapter)
    from their route until their last byte, and waits for none to."""

    def __init__(self) -> None:
        self.in_flight = 0  # HTTP requests routed here and not yet over
        self._idle = trio.Event()
        self._idle.set()

    def hold(self) -> None:
        """One more request in flight; let go when that HTTP request is over."""
        self.in_flight += 1
        self._idle = trio.Event() if self.in_flight == 1 else self._idle
        if not at_request_end(self._release):
            self._release()  # not inside a served request (nothing would release it)

    def _release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def idle(self) -> None:
        """Return once no request holds this."""
        while self.in_flight:
            await self._idle.wait()


# The routes a model serves, on its card: every one for a decoder, the embedding ones for an encoder.
MODEL_ROUTES = (
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/sessions", "/v1/embeddings", "/v1/rerank",
    "/v1/score",
)  # fmt: skip
ENCODER_ROUTES = ("/v1/embeddings", "/v1/rerank", "/v1/score")
CROSS_ENCODER_ROUTES = ("/v1/rerank", "/v1/score")


class Model(Held):
    """One served model: its name, its engine's config and, once ready, the
    engine and what the routes need of it (chat template, reasoning split)."""

    adapter_key: str | None = None  # a base model runs no LoRA adapter

    def __init__(self, name: str, config: EngineConfig, *, reasoning_parser: str, checkpoint: Checkpoint | None = None) -> None:
        super().__init__()
        self.name = name
        self.config = config
        self.reasoning_parser = reasoning_parser
        self.checkpoint = checkpoint  # preloaded, or None to load config.model
        self._state = "loading"
        self.fault: str | None = None  # why the engine's actors ended on their own, once they did
        self.created = openai.now()
        self.engine: Engine | None = None
        self.template: ChatTemplate | None = None
        self.reasoning = False  # split <think> reasoning out of replies
        self.scope = trio.CancelScope()  # cancelled: the engine stops
        self.stopped = trio.Event()  # the engine's block is left: its memory is let go
        self.rope = RopeTables(0, 0, 0)  # its RoPE tables, once its settings are read (`Registry.load`)

    @property
    def state(self) -> str:
        """loading, ready, unloading, or dead: ready but its engine is dead
        (`dead` says why)."""
        if self._state == "ready" and self.dead is not None:
            return "dead"
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value

    @property
    def dead(self) -> str | None:
        """Why the engine is dead, or None while it is not (or not yet loaded)."""
        if self.fault is not None:
            return self.fault
        engine = self.engine
        return engine.statistics().dead if engine is not None else None

    @property
    def bytes(self) -> int:
        """What the memory budget counts for this model: its weights file
        (the directory's files for a Hugging Face one), its KV pool, and
        its RoPE tables (0 until its settings are read)."""
        return weights_bytes(self.config.model) + self.config.kv_cache_bytes + self.rope.bytes

    async def serve(self, named: bool, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine until `scope` is cancelled. Reports started once
        it is ready; a failed load raises before that. Its progress lines
        and its start-up line name it when ``named`` (not the first model).
        Once started, an exception from the engine (its actors ending on
        their own: a bug) ends only this model: it is dead with the cause,
        and nothing is raised into the registry's nursery."""
        started = False
        try:
            with self.scope:
                loading = None if self.checkpoint is not None else ProgressBar(f"Loading weights of {self.name}" if named else "Loading weights")
                building = ProgressBar(f"Building {self.name}" if named else "Building the model", unit="layers")
                async with open_engine(self.config, checkpoint=self.checkpoint, progress=loading, build_progress=building) as engine:
                    building.finish()
                    self.checkpoint = None  # the engine holds what it needs; nothing else keeps the tensors
                    tok = engine.tokenizer
                    # Compiled and checked in a child process (models/bounded.py), off the event loop:
                    # a template past its budget raises TemplateOverrun and the load fails.
                    template = functools.partial(ChatTemplate, tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
                    self.template = await trio.to_thread.run_sync(template)
                    mode = self.reasoning_parser
                    self.reasoning = mode == "on" or (mode == "auto" and len(tok.encode(THINK_OPEN, add_bos=False)) == 1)
                    self.engine = engine
                    who = f"{self.name} " if named else ""
                    print(f"trioserve: {who}computing on {describe_compute(engine.compute)}", file=sys.stderr, flush=True)
                    if engine.trace_path is not None:
                        print(f"trioserve: recording {self.name}'s engine inputs to {engine.trace_path}", file=sys.stderr, flush=True)
                    started = True
                    task_status.started()
                    await trio.sleep_forever()
        except Exception as exc:
            if not started:
                raise  # a failed load: `Registry.load` frees the name and says why
            self.fault = f"the engine stopped: {_one_line(exc)}"
            print(f"trioserve: the engine of {self.name} stopped after a fault; it is dead until unloaded:", file=sys.stderr, flush=True)
            traceback.print_exception(exc, file=sys.stderr)
        finally:
            self.engine = None
            self.template = None
            self.stopped.set()

    def card(self) -> dict:
        """The model as /v1/models lists it."""
        card = {"id": self.name, "object": "model", "created": self.created, "owned_by": "trioserve", "state": self.state}
        if card["state"] == "dead":
            card["cause"] = self.dead
        engine = self.engine
        if engine is not None:
            card["max_model_len"] = engine.max_model_len
            card["batch_invariant"] = engine.config.batch_invariant
            card["activations"] = engine.activations
            card["compute"] = engine.compute
            card["family"] = engine.model_config.architecture if engine.model_config is not None else None
            # What the model serves: an encoder gives embeddings alone (models/bert.py).
            card["routes"] = list(CROSS_ENCODER_ROUTES if engine.is_cross_encoder else ENCODER_ROUTES if engine.is_encoder else MODEL_ROUTES)
        return card


class Adapter(Held):
    """A LoRA adapter served as a model of its own name over its base
    model's engine: routed to like a model, its rows run with the adapter
    (GenerateRequest.adapter is its key, fresh for every load, so a
    reloaded adapter never meets its predecessor's cached KV)."""

    def __init__(self, name: str, base: Model, key: str, path: str, owner: str | None = None) -> None:
        super().__init__()
        self.name = name
        self.base = base
        self.key = key
        self.path = path
        # The tenant that loaded it through /v1/lora_adapters, the only one
        # that sees, uses or unloads it; None: loaded for everyone (--lora).
        self.owner = owner
        self._state = "loading"
        self.rank = 0
        self.created = openai.now()

    @property
    def adapter_key(self) -> str:
        return self.key

    @property
    def state(self) -> str:
        """Its own state, or dead while its base model's engine is."""
        return "dead" if self._state == "ready" and self.base.state == "dead" else self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value

    @property
    def dead(self) -> str | None:
        return self.base.dead

    @property
    def engine(self) -> Engine | None:
        return self.base.engine

    @property
    def template(self) -> ChatTemplate | None:
        return self.base.template

    @property
    def reasoning(self) -> bool:
        return self.base.reasoning

    def hold(self) -> None:
        super().hold()
        self.base.hold()  # an unload of the base model drains its adapters' requests too

    def card(self) -> dict:
        """The adapter as /v1/models lists it (vLLM's shape: its base model as ``parent``)."""
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "trioserve", "state": self.state, "parent": self.base.name}

    def visible_to(self, tenant: str | None) -> bool:
        """Whether ``tenant`` (None: the server itself) sees this adapter."""
        return self.owner is None or tenant is None or self.owner == tenant

    def describe(self, *, with_path: bool = True) -> dict:
        """The adapter as GET /v1/lora_adapters lists it (its path only to a
        server without API keys: a tenant never learns the server's directories)."""
        out = {"name": self.name, "base_model": self.base.name, "rank": self.rank, "state": self.state, "requests_in_flight": self.in_flight}
        out["shared"] = self.owner is None
        return {**out, "path": self.path} if with_path else out


class RopeTables:
    """The size of a model's RoPE tables, as the model makes them
    (models/decoder.py `rope_tables`): a cos and a sin table, float32,
    [positions, head_dim / 2] each, where positions is min(the file's
    context length, --max-model-len), one such pair per RoPE base its
    layers use (a family with local sliding-window layers of their own base
    has two). So bytes = pairs x 2 x positions x head_dim / 2 x 4."""

    def __init__(self, positions: int, head_dim: int, pairs: int) -> None:
        self.positions = positions
        self.head_dim = head_dim
        self.pairs = pairs
        self.bytes = pairs * 2 * positions * (head_dim // 2) * 4

    @classmethod
    def of(cls, config: ModelConfig, max_model_len: int | None) -> RopeTables:
        positions = config.max_position if max_model_len is None else max(1, min(config.max_position, max_model_len))
        local = getattr(config, "rope_local_theta", None)
        pairs = 2 if local is not None and local != config.rope_theta else 1
        return cls(positions, config.head_dim, pairs)

    def describe(self) -> str:
        pairs = "" if self.pairs == 1 else f"{self.pairs} pairs of "
        return f"{pairs}cos and sin for {self.positions} positions x {self.head_dim // 2} frequencies, float32"


def declared_config(path: str) -> ModelConfig | None:
    """The settings of the model at ``path`` (a GGUF file's metadata, a
    Hugging Face directory's config.json), read as the loader reads them
    but without any weights; None where they cannot be read (the load then
    says why). Blocking: a GGUF header of a large vocabulary takes tenths
    of a second to walk."""
    from trioserve.models.checkpoint import resolve_model_path
    from trioserve.models.config import config_from_gguf, config_from_hf
    from trioserve.models.files import MAX_JSON, FileRefused, read_text
    from trioserve.models.gguf_file import open_reader

    try:
        where = Path(resolve_model_path(path))
        if where.is_dir():
            return config_from_hf(json.loads(read_text(where / "config.json", MAX_JSON)), where / "config.json")
        reader = open_reader(where)  # a regular file's, checked before it is opened
        names = {t.name: t for t in reader.tensors}
        embed = names.get("token_embd.weight")
        if embed is None or not embed.shape:
            return None
        return config_from_gguf(reader.metadata, where, vocab_size=int(embed.shape[-1]), tie_embeddings="output.weight" not in names)
    except (OSError, ValueError, RecursionError, FileRefused, CheckpointError, TrioserveError):
        return None


def weights_bytes(path: str) -> int:
    """The size of a model's weights on disk: a file's, or the weight files
    of a directory (0 where it cannot be read: the load then says why)."""
    from trioserve.models.checkpoint import resolve_model_path

    try:
        where = Path(resolve_model_path(path))
        if where.is_dir():
            return sum(f.stat().st_size for f in where.iterdir() if f.suffix in (".safetensors", ".gguf", ".bin"))
        return where.stat().st_size
    except (OSError, CheckpointError, TrioserveError):
        return 0


class Registry:
    """The served models by name. Every change happens on the event loop
    with no await between its check and its change, so two loads of one
    name cannot both pass the check."""

    def __init__(self, settings: ServerSettings, nursery: trio.Nursery) -> None:
        self.settings = settings
        self.models: dict[str, Model] = {}
        self.adapters: dict[str, Adapter] = {}
        self._loads = 0  # adapters loaded so far: each load's key is new
        self._nursery = nursery
        self._load_lock = trio.Lock()  # one load at a time

    # -- routing ---------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.models)

    def visible_adapters(self, tenant: str | None = None) -> list[Adapter]:
        """The adapters ``tenant`` sees (its own and the shared ones; None: all)."""
        return [a for a in self.adapters.values() if a.visible_to(tenant)]

    def route(self, name: object, field: str = "model", tenant: str | None = None) -> Model | Adapter:
        """The ready model a request's ``model`` names, held for the rest of
        the request; with one model served, a request may leave it out.
        ``tenant``: another tenant's adapter is not there for it (None: the
        server itself, which sees everything)."""
        if name is not None and not isinstance(name, str):
            raise RequestError(f"{field}: expected a string, got {type(name).__name__}", field=field)
        if name is None:
            if len(self.models) != 1:
                served = ", ".join(repr(n) for n in self.models) or "none"
                raise RequestError(f"{field}: required, this server serves several models ({served})", field=field)
            name = next(iter(self.models))
        model = self.models.get(name)
        if model is None:
            adapter = self.adapters.get(name)
            model = adapter if adapter is not None and adapter.visible_to(tenant) else None
        if model is None:
            served = ", ".join(repr(n) for n in [*self.models, *(a.name for a in self.visible_adapters(tenant))]) or "none"
            raise HTTPError(404, f"the model {name!r} does not exist (this server serves {served})", param=field, code="model_not_found")
        if model.state == "loading":
            raise HTTPError(
                503, f"the model {name!r} is still loading", kind="server_error", code="loading", headers={"Retry-After": str(LOAD_RETRY_AFTER_S)}
            )
        if model.state == "unloading":
            raise HTTPError(503, f"the model {name!r} is being unloaded", kind="server_error", code="model_unloading")
        if model.state == "dead":
            raise HTTPError(
                503, f"the model {name!r} is dead: {model.dead} (it answers nothing until an admin unloads it and loads it again)",
                kind="server_error", code="engine_dead",
            )
        model.hold()
        return model

    # -- loading ---------------------------------------------------------------
    def reserve(self, name: str, config: EngineConfig, *, checkpoint: Checkpoint | None = None) -> Model:
        """Take ``name`` for a model about to load (not routable yet), after
        checking it fits the memory budget; 409 when the name is taken."""
        taken = self.models.get(name) or self.adapters.get(name)
        if taken is not None:
            raise HTTPError(409, f"the model name {name!r} is {_taken(taken)}", param="name", code="model_exists")
        model = Model(name, config, reasoning_parser=self.settings.reasoning_parser, checkpoint=checkpoint)
        self._check_budget(model)  # its file and KV pool; its RoPE tables are counted as its load begins
        self.models[name] = model
        return model

    def _check_budget(self, model: Model) -> None:
        """400 over_memory_budget when ``model`` does not fit beside the
        other models (those loading counted) within --memory-budget."""
        budget = self.settings.memory_budget
        if budget is None:
            return
        used = sum(m.bytes for m in self.models.values() if m is not model)
        need = model.bytes
        if used + need <= budget:
            return
        kv, rope = model.config.kv_cache_bytes, model.rope
        parts = f"weights {need - kv - rope.bytes} + KV pool {kv}" + (f" + RoPE tables {rope.bytes}: {rope.describe()}" if rope.bytes else "")
        raise HTTPError(
            400,
            f"loading {model.name!r} needs {need} bytes ({parts}); "
            f"the served models take {used} of the {budget}-byte --memory-budget, leaving {budget - used}",
            param="path", code="over_memory_budget",
        )  # fmt: skip

    async def load(self, model: Model, *, named: bool = True) -> Model:
        """Load a reserved model, one load at a time, and publish it. A
        failure frees its name and is raised. First its RoPE tables are
        counted against the budget (their size is in its settings, read
        here, in a thread), before any of it is made."""
        try:
            async with self._load_lock:
                settings = model.checkpoint.config if model.checkpoint is not None else await trio.to_thread.run_sync(declared_config, model.config.model)
                if settings is not None:  # None: unreadable, and the load says why
                    model.rope = RopeTables.of(settings, model.config.max_model_len)
                    self._check_budget(model)  # the sum and the check with no await between: every other load's tables are in
                await self._nursery.start(model.serve, named)
        except BaseException:
            if self.models.get(model.name) is model:
                del self.models[model.name]
            raise
        model.state = "ready"  # published: routable from here on
        return model

    # -- unloading -------------------------------------------------------------
    async def unload(self, name: str, timeout_s: float) -> dict:
        """Stop routing to ``name``; let its requests finish for up to
        ``timeout_s``; end the rest with an error event; stop its engine.
        What happened, for the admin route's answer."""
        model = self.models.get(name)
        if model is None:
            raise HTTPError(404, f"the model {name!r} does not exist", param="name", code="model_not_found")
        if any(a.base is model for a in self.adapters.values()):
            raise HTTPError(409, f"the model {name!r} has LoRA adapters loaded; unload them first", param="name", code="model_busy")
        if model.state not in ("ready", "dead"):
            raise HTTPError(409, f"the model {name!r} is {model.state}", param="name", code="model_busy")
        model.state = "unloading"
        engine = model.engine  # None when its actors ended on their own (Model.fault)
        waiting, ended = await _drain(model, timeout_s, lambda: engine is not None and engine.stop(f"the model {name!r} was unloaded"))
        model.scope.cancel()
        await model.stopped.wait()
        del self.models[name]
        engine = model = None  # noqa: F841 - this frame's own references go before the collection, not when it returns
        for _ in range(3):  # what the engine's tasks let go of as they unwind, collected as it goes
            release_memory()
            await trio.sleep(0.05)
        return {"name": name, "unloaded": True, "requests_in_flight": waiting, "requests_ended": ended}

    # -- LoRA adapters -----------------------------------------------------------
    async def load_adapter(self, name: str, path: str, base_name: str | None = None, *, owner: str | None = None, tenants: int = 1) -> Adapter:
        """Read the PEFT adapter at ``path``, check it against its base model
        (the only model, or ``base_name``), make it resident and publish it
        under ``name``, for ``owner`` alone (None: for everyone). 409 when
        the name is taken; AdapterError (400) naming a mismatch; 400 when the
        base model holds --max-loras already (those still loading counted),
        or ``owner`` holds its even share of them between ``tenants``."""
        if base_name is None and len(self.models) != 1:
            raise RequestError("base_model: required, this server serves several models", field="base_model")
        base = self.models.get(base_name) if base_name is not None else next(iter(self.models.values()))
        if base is None or base.state != "ready" or base.engine is None:
            raise HTTPError(404, f"the base model {base_name!r} is not served (or not ready)", param="base_model", code="model_not_found")
        taken = self.models.get(name) or self.adapters.get(name)
        if taken is not None:
            raise HTTPError(409, f"the model name {name!r} is {_taken(taken)}", param="name", code="model_exists")
        if base.engine.is_encoder:
            raise RequestError(f"base_model: {base.engine.encoder_routes()}; it takes no LoRA adapters", field="base_model")
        slots = base.engine.adapters
        on_base = [a for a in self.adapters.values() if a.base is base]  # loading ones too: concurrent loads cannot all pass
        if owner is not None:
            # Each key's even share of the room the operator's adapters leave (at least one), so no key fills it for the others.
            share = max(1, (slots.capacity - sum(a.owner is None for a in on_base)) // max(tenants, 1))
            mine = sum(a.owner == owner for a in on_base)
            if mine >= share:
                raise HTTPError(
                    400, f"this API key holds {mine} adapters on {base.name!r}, its share ({share}) of --max-loras ({slots.capacity}); unload one first",
                    param="name", code="too_many_adapters",
                )  # fmt: skip
        if len(on_base) >= slots.capacity:
            raise HTTPError(400, f"{base.name!r} holds {len(on_base)} adapters, as many as --max-loras ({slots.capacity}) allows; unload one first", param="name", code="too_many_adapters")
        self._loads += 1
        adapter = Adapter(name, base, f"{name}#{self._loads}", path, owner)
        self.adapters[name] = adapter  # reserved: routes answer 503 loading until it is in
        try:
            read = await trio.to_thread.run_sync(lambda: load_lora_adapter(path, slots.model_config, name=name, max_rank=slots.max_rank))
            await slots.add(adapter.key, read)
        except BaseException:
            del self.adapters[name]
            raise
        adapter.rank = read.rank
        adapter.state = "ready"
        return adapter

    async def unload_adapter(self, name: str, timeout_s: float, tenant: str | None = None) -> dict:
        """Drain ``name`` as `unload` drains a model (its requests finish up
        to ``timeout_s``, the rest end with an error event), then let it go.
        ``tenant`` (None: the server) may unload only its own: another's is
        not there for it, a shared one is the operator's (403)."""
        adapter = self.adapters.get(name)
        if adapter is None or not adapter.visible_to(tenant):
            raise HTTPError(404, f"no LoRA adapter {name!r}", param="name", code="adapter_not_found")
        if tenant is not None and adapter.owner != tenant:
            raise HTTPError(403, f"the LoRA adapter {name!r} was loaded for every API key by the operator (--lora); it is unloaded with the server", kind="permission_error", param="name", code="adapter_shared")
        if adapter.state not in ("ready", "dead"):  # a dead base model's adapters can go, so it can be unloaded
            raise HTTPError(409, f"the adapter {name!r} is {adapter.state}", param="name", code="adapter_busy")
        adapter.state = "unloading"
        engine = adapter.engine
        waiting, ended = await _drain(adapter, timeout_s, lambda: engine is not None and engine.fail_adapter(adapter.key, f"the LoRA adapter {name!r} was unloaded"))
        if engine is not None and engine.adapters is not None:
            await engine.adapters.remove(adapter.key)
        del self.adapters[name]
        return {"name": name, "unloaded": True, "requests_in_flight": waiting, "requests_ended": ended}

    def stats(self) -> list[dict]:
        """Each model's state, memory and requests in flight (GET /admin/models)."""
        out = []
        for model in self.models.values():
            engine = model.engine
            stats = engine.statistics() if engine is not None else None
            out.append({
                "name": model.name, "path": model.config.model, "state": model.state, "memory_bytes": model.bytes,
                "requests_in_flight": model.in_flight,
                "running": stats.running if stats else 0, "waiting": stats.waiting if stats else 0,
                **({"cause": model.dead} if model.state == "dead" else {}),
            })  # fmt: skip
        return out


def _taken(held: Held) -> str:
    """Why a name cannot be loaded again: what holds it now."""
    state = held.state
    if state == "ready":
        return "already served"
    if state == "dead":
        return "taken by a dead model; unload it first"
    return f"already {state}"


def _one_line(exc: BaseException) -> str:
    """An exception as one line, naming its type (a group: its first leaf)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return " ".join(f"{type(exc).__name__}: {exc}".split())


async def _drain(held: Held, timeout_s: float, end_the_rest) -> tuple[int, int]:
    """Let ``held``'s requests in flight finish for up to ``timeout_s``;
    then ``end_the_rest()`` (each gets an error event) and give them
    STOP_GRACE_S to send it. (Requests in flight at first, requests ended.)"""
    waiting = held.in_flight
    with trio.move_on_after(timeout_s):
        await held.idle()
    ended = held.in_flight
    if ended:
        end_the_rest()
        with trio.move_on_after(STOP_GRACE_S):
            await held.idle()
    return waiting, ended


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20


def fix_mmap_threshold() -> bool:
    """Have glibc serve every allocation of 1 MiB or more (weights,
    packed kernels' copies, KV blocks) from its own mapping, which goes
    back to the system when freed. By default glibc raises that threshold
    each time such a mapping is freed (up to 32 MiB), so after a model is
    unloaded the next one's buffers land in the heap's arenas, where what
    is freed mostly stays in the process. Setting it fixes it. True where
    it was set (glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    except (OSError, AttributeError):
        return False


def release_memory() -> None:
    """Give an unloaded model's memory back: collect what refers to it, then
    ask glibc to return freed pages to the system."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass


@asynccontextmanager
async def open_registry(settings: ServerSettings) -> AsyncIterator[Registry]:
    """A registry whose models' engines run in its nursery; leaving the block
    stops them all (`load_startup_models` loads the settings' models)."""
    async with trio.open_nursery() as nursery:
        registry = Registry(settings, nursery)
        try:
            yield registry
        finally:
            nursery.cancel_scope.cancel()


async def load_startup_models(registry: Registry, checkpoint: Checkpoint | None) -> None:
    """Reserve every model of the settings, then load them in order. The
    first failure stops the server (as a bad --model always has)."""
    specs = registry.settings.models()
    reserved = [registry.reserve(name, config, checkpoint=checkpoint if i == 0 else None) for i, (name, config) in enumerate(specs)]
    for i, model in enumerate(reserved):
        await registry.load(model, named=i > 0)
    for name, path in registry.settings.loras:  # --lora NAME=PATH: on the first model
        await registry.load_adapter(name, path, reserved[0].name)
