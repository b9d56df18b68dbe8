"""Load generator for any OpenAI-compatible server (trioserve, vLLM,
llama.cpp's server, ...): streaming chat completions at one or more
concurrency levels, measuring throughput, time to first token and
inter-token latency from the client's side.

    .venv/bin/python bench/serve.py --base-url http://127.0.0.1:8000 \\
        [--model ID] [--concurrency 1 --concurrency 8 ...] [--requests R] \\
        [--prompt-tokens 128] [--max-tokens 128] [--api-key KEY] \\
        [--timeout 600] [--seed 0] [--route chat|responses]

With ``--route responses`` the same requests go to POST /v1/responses
(``input``, ``max_output_tokens``, ``store: false``); text is read from its
``response.output_text.delta`` events and usage from ``response.completed``.

Each level keeps exactly N requests in flight (N workers pulling request
numbers from an unbuffered channel) until R requests (default 2N) have run.
Every request is ``stream: true`` with ``stream_options.include_usage``,
temperature 0, ``max_tokens`` M and ``ignore_eos: true``. vLLM and trioserve
honour ignore_eos; servers without it (llama.cpp ignores unknown fields) may
stop before M tokens, so the report always uses the tokens actually produced.

What is measured, per request:
- TTFT: from just before the request is sent to the first chunk with
  non-empty generated text (``delta.content``, or ``delta.reasoning_content``
  for servers that split reasoning out). The server's role-only opening chunk
  does not count.
- ITL: the gaps between consecutive chunks with generated text. A chunk that
  carries several tokens (a server may batch them, or hold back a partial
  UTF-8 character) counts as ONE gap, so ITL is per chunk, not strictly per
  token.
- output tokens: ``usage.completion_tokens`` when the server reports it,
  otherwise the number of chunks with generated text.
- end-to-end time: from sending to the end of the stream.
- prompt tokens (table only): the server's usage.prompt_tokens, which
  includes the chat template (a default system prompt, role markers), so it
  runs above --prompt-tokens; "n/a" when the server reports no usage.

Per level: throughput = output tokens of the successful requests / wall time
of the level; TTFT and ITL p50/p99 (nearest rank) over successful requests;
errors = non-200 answers, error events in the stream, timeouts and transport
failures (each failed request is counted, never raised).

Prints a markdown table, one row per level, then as its LAST line one JSON
object for the last level:
{"concurrency": n, "tokens_per_s": x, "ttft_ms": {"p50": .., "p99": ..}, "itl_ms": {"p50": .., "p99": ..}}

Exit status 0 when at least one request succeeded, 1 otherwise (including a
server that cannot be reached).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import secrets
import sys
import time
from dataclasses import dataclass, field

import httpx
import trio

# Short, common English words: with a leading space each is one token in the
# BPE vocabularies of the usual models (Llama, Qwen, SmolLM, GPT-2 family).
WORDS = (
    "the of and to in is that it for on with as was at by be this from or are "
    "one all we can had have there were but not when your which what their said "
    "time will way about many then them would like so these her long make thing "
    "see him two has look more day could come did number sound most people over "
    "know water than call first who may down side been now find any new work part"
).split()
# Rough token count of the unique prefix below ("Request <8 hex>-<level>-<i>:").
PREFIX_TOKENS = 10

ERROR_SNIPPET = 200


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least p% of the
    values at or below it. None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def normalize_base_url(url: str) -> str:
    """'http://h:8000', 'http://h:8000/', 'http://h:8000/v1/' -> 'http://h:8000/v1'."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url + "/v1"


def build_prompt(rng: random.Random, run_id: str, level: int, index: int, prompt_tokens: int) -> str:
    """A user message of roughly ``prompt_tokens`` tokens.

    The count is approximate: it assumes one token per filler word and about
    PREFIX_TOKENS for the prefix, and the chat template adds its own tokens.
    When the server reports usage.prompt_tokens the report shows that real
    count instead of this target.

    The prefix is unique per run, level and request (run_id is random on every
    invocation, whatever --seed says), and sits at the very start of the
    message, so no prefix cache, within or across runs, can serve the
    filler. --seed fixes only the filler words.
    """
    prefix = f"Request {run_id}-{level}-{index}:"
    n_words = max(1, prompt_tokens - PREFIX_TOKENS)
    return prefix + " " + " ".join(rng.choice(WORDS) for _ in range(n_words))


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # seconds
    gaps: list[float] = field(default_factory=list)  # seconds between content chunks
    chunks: int = 0  # chunks with generated text
    completion_tokens: int | None = None  # from usage, when reported
    prompt_tokens: int | None = None  # from usage, when reported
    e2e: float | None = None  # seconds

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks


RESPONSES_TEXT_EVENTS = ("response.output_text.delta", "response.reasoning_text.delta")
RESPONSES_END_EVENTS = ("response.completed", "response.incomplete")


def _usage(obj: dict) -> dict | None:
    """The usage a chunk reports, in chat's names: a chat chunk's own, or
    the response's in a Responses API end event."""
    usage = obj.get("usage")
    if isinstance(usage, dict):
        return usage
    response = obj.get("response") if obj.get("type") in RESPONSES_END_EVENTS else None
    usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return None
    return {"completion_tokens": usage.get("output_tokens"), "prompt_tokens": usage.get("input_tokens")}


def _chunk_text(obj: dict) -> str:
    """Generated text in one streamed chat chunk (all choices), or in one
    Responses API event (its text and reasoning deltas)."""
    if obj.get("type") in RESPONSES_TEXT_EVENTS:
        return obj.get("delta") if isinstance(obj.get("delta"), str) else ""
    text = ""
    for choice in obj.get("choices") or []:
        delta = choice.get("delta") or {}
        for key in ("content", "reasoning_content"):
            part = delta.get(key)
            if isinstance(part, str):
                text += part
        if not delta and isinstance(choice.get("text"), str):  # a completions-style chunk
            text += choice["text"]
    return text


async def one_request(client: httpx.AsyncClient, url: str, body: dict, timeout: float) -> Result:
    """Send one streaming chat completion and time its chunks. Never raises
    for a failed request: the failure is recorded in the Result."""
    res = Result()
    last: float | None = None
    t0 = time.perf_counter()
    with trio.move_on_after(timeout) as scope:
        try:
            async with client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    raw = await response.aread()
                    res.error = f"HTTP {response.status_code}: {raw[:ERROR_SNIPPET].decode('utf-8', 'replace').strip()}"
                    return res
                done = False  # saw [DONE] or a finish_reason
                async for line in response.aiter_lines():
                    line = line.strip()
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, "event:" lines
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        done = True
                        continue  # read on to the body's end: a generator left half read warns when collected
                    try:
                        obj = json.loads(data)
                    except json.JSONDecodeError:
                        res.error = f"unparsable event: {data[:ERROR_SNIPPET]}"
                        return res
                    if not isinstance(obj, dict):
                        continue
                    if obj.get("type") == "response.failed":
                        obj = {"error": (obj.get("response") or {}).get("error") or "response.failed"}
                    if obj.get("error") is not None:
                        err = obj["error"]
                        msg = err.get("message", err) if isinstance(err, dict) else err
                        res.error = f"error event: {str(msg)[:ERROR_SNIPPET]}"
                        return res
                    if any((c or {}).get("finish_reason") for c in obj.get("choices") or []) or obj.get("type") in RESPONSES_END_EVENTS:
                        done = True  # some servers end the stream without [DONE]; a Responses stream never sends it
                    usage = _usage(obj)
                    if isinstance(usage, dict):
                        if isinstance(usage.get("completion_tokens"), int):
                            res.completion_tokens = usage["completion_tokens"]
                        if isinstance(usage.get("prompt_tokens"), int):
                            res.prompt_tokens = usage["prompt_tokens"]
                    if _chunk_text(obj):
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.gaps.append(now - last)
                        last = now
                        res.chunks += 1
                if not done:
                    # Neither [DONE] nor a finish_reason: the stream was cut off.
                    res.error = "stream ended early (no finish_reason, no [DONE])"
                    return res
        except httpx.HTTPError as exc:
            res.error = f"{type(exc).__name__}: {str(exc)[:ERROR_SNIPPET] or 'transport error'}"
            return res
        except Exception as exc:  # anything else about one request is its error, not a crash
            res.error = f"{type(exc).__name__}: {str(exc)[:ERROR_SNIPPET]}"
            return res
    if scope.cancelled_caught:
        res.error = f"timed out after {timeout:g} s"
        return res
    res.e2e = time.perf_counter() - t0
    if res.chunks == 0 and not res.completion_tokens:
        res.error = "no generated text in the stream"
        return res
    res.ok = True
    return res


@dataclass
class Level:
    concurrency: int
    results: list[Result]
    wall: float
    not_run: int  # requests the level's deadline left unsent

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.ok]

    @property
    def errors(self) -> int:
        return len(self.results) - len(self.ok) + self.not_run

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall if self.wall > 0 else 0.0

    def ttft_ms(self, p: float) -> float | None:
        v = percentile([r.ttft for r in self.ok if r.ttft is not None], p)
        return None if v is None else v * 1000.0

    def itl_ms(self, p: float) -> float | None:
        v = percentile([g for r in self.ok for g in r.gaps], p)
        return None if v is None else v * 1000.0

    def e2e_ms(self, p: float) -> float | None:
        v = percentile([r.e2e for r in self.ok if r.e2e is not None], p)
        return None if v is None else v * 1000.0

    def prompt_tokens(self) -> str:
        counts = [r.prompt_tokens for r in self.ok if r.prompt_tokens is not None]
        return f"{sum(counts) / len(counts):.0f}" if counts else "n/a"


async def run_level(client: httpx.AsyncClient, args, model: str, run_id: str, concurrency: int) -> Level:
    total = args.requests if args.requests is not None else 2 * concurrency
    rng = random.Random(f"{args.seed}-{concurrency}")
    prompts = [build_prompt(rng, run_id, concurrency, i, args.prompt_tokens) for i in range(total)]
    route = getattr(args, "route", "chat")
    url = args.api + ("/responses" if route == "responses" else "/chat/completions")
    results: list[Result] = []
    sent = 0

    async def producer(send: trio.MemorySendChannel) -> None:
        nonlocal sent
        async with send:
            for i in range(total):
                await send.send(i)  # unbuffered: waits until a worker is free
                sent += 1

    async def worker(receive: trio.MemoryReceiveChannel) -> None:
        async with receive:
            async for i in receive:
                if route == "responses":  # the same request in the Responses API's terms, kept nowhere
                    body = {
                        "model": model, "input": prompts[i], "max_output_tokens": args.max_tokens, "temperature": 0,
                        "stream": True, "store": False, "ignore_eos": True,
                    }  # fmt: skip
                else:
                    body = {
                        "model": model,
                        "messages": [{"role": "user", "content": prompts[i]}],
                        "max_tokens": args.max_tokens,
                        "temperature": 0,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                        "ignore_eos": True,
                    }
                results.append(await one_request(client, url, body, args.timeout))

    # Each worker runs at most ceil(total / concurrency) requests, each bounded
    # by --timeout; the level as a whole gets that bound plus a margin.
    deadline = args.timeout * math.ceil(total / concurrency) + 30.0
    t0 = time.perf_counter()
    with trio.move_on_after(deadline):
        async with trio.open_nursery() as nursery:
            send, receive = trio.open_memory_channel(0)
            async with send, receive:
                nursery.start_soon(producer, send.clone())
                for _ in range(concurrency):
                    nursery.start_soon(worker, receive.clone())
    wall = time.perf_counter() - t0
    # Requests cut off by the deadline (in flight or never sent) are errors.
    return Level(concurrency, results, wall, not_run=total - len(results))


async def find_model(client: httpx.AsyncClient, args) -> str | None:
    """The model to use: --model, else the first id of GET /v1/models.
    Exits with a message when the server can't be reached."""
    try:
        with trio.fail_after(min(args.timeout, 30.0)):
            response = await client.get(args.api + "/models")
    except (httpx.HTTPError, trio.TooSlowError) as exc:
        fail(f"cannot reach the server at {args.api}: {type(exc).__name__}: {exc or 'timed out'}")
    if args.model:
        return args.model
    if response.status_code != 200:
        fail(f"GET {args.api}/models answered HTTP {response.status_code}: {response.text[:ERROR_SNIPPET]}; pass --model")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        fail(f"GET {args.api}/models gave no model id ({response.text[:ERROR_SNIPPET]!r}); pass --model")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(1)


def fmt(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def rounded(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


async def main_async(args) -> int:
    levels_c = args.concurrency or [1]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    top = max(levels_c)
    # A pooled connection idle for a second is dropped, not reused: llama-server
    # (cpp-httplib) closes one idle for 5 s, httpx's own expiry is also 5 s,
    # and a request sent on a connection the server has just closed fails
    # with "Server disconnected without sending a response" (seen at 1-16
    # streams of a 1B model, whose requests leave connections idle that long).
    limits = httpx.Limits(max_connections=top, max_keepalive_connections=top, keepalive_expiry=1.0)
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0), pool=args.timeout)
    run_id = secrets.token_hex(4)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        model = await find_model(client, args)
        print(
            f"target {args.api}  model {model}  prompt ~{args.prompt_tokens} tok  "
            f"max_tokens {args.max_tokens}  levels {levels_c}",
            flush=True,
        )
        levels: list[Level] = []
        for c in levels_c:
            level = await run_level(client, args, model, run_id, c)
            levels.append(level)
            print(f"concurrency {c}: {len(level.ok)} ok, {level.errors} errors in {level.wall:.2f} s", flush=True)
            seen: set[str] = set()
            for r in level.results:
                if r.error and r.error not in seen and len(seen) < 3:
                    seen.add(r.error)
                    print(f"  error: {r.error}", flush=True)
            if level.not_run:
                print(f"  {level.not_run} requests cut off by the level's deadline", flush=True)

    # Said before the table, so the JSON object stays the last line of output.
    succeeded = any(lv.ok for lv in levels)
    if not succeeded:
        print("error: no request succeeded", file=sys.stderr, flush=True)
    print()
    print("| concurrency | requests | errors | prompt tok | output tok | wall s | tokens/s "
          "| TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | E2E p50 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for lv in levels:
        print(
            f"| {lv.concurrency} | {len(lv.results) + lv.not_run} | {lv.errors} | {lv.prompt_tokens()} "
            f"| {lv.output_tokens} | {lv.wall:.2f} | {lv.tokens_per_s:.1f} "
            f"| {fmt(lv.ttft_ms(50))} | {fmt(lv.ttft_ms(99))} | {fmt(lv.itl_ms(50))} | {fmt(lv.itl_ms(99))} "
            f"| {fmt(lv.e2e_ms(50))} |"
        )
    last = levels[-1]
    print(json.dumps({
        "concurrency": last.concurrency,
        "tokens_per_s": round(last.tokens_per_s, 1),
        "ttft_ms": {"p50": rounded(last.ttft_ms(50)), "p99": rounded(last.ttft_ms(99))},
        "itl_ms": {"p50": rounded(last.itl_ms(50)), "p99": rounded(last.itl_ms(99))},
    }), flush=True)
    return 0 if succeeded else 1


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be more than 0")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Streaming load generator for OpenAI-compatible servers.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address, with or without /v1")
    p.add_argument("--model", help="model id (default: the first id from GET /v1/models)")
    p.add_argument("--concurrency", type=positive_int, action="append",
                   help="requests in flight; repeat to run several levels (default 1)")
    p.add_argument("--requests", type=positive_int, help="requests per level (default 2 x concurrency)")
    p.add_argument("--prompt-tokens", type=positive_int, default=128, help="approximate prompt length (default 128)")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="output tokens per request (default 128)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--seed", type=int, default=0, help="seed for the prompts' filler words (default 0)")
    p.add_argument("--route", choices=("chat", "responses"), default="chat",
                   help="stream chat completions (default) or the same requests through POST /v1/responses")
    args = p.parse_args(argv)
    args.api = normalize_base_url(args.base_url)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return trio.run(main_async, args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
