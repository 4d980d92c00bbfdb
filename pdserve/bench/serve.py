"""`pdserve bench serve`: latency and throughput of an OpenAI-compatible HTTP endpoint (pdserve
serve, vLLM, ...) under a stream of requests, measured from the client.

Requests (from a dataset: random token ids, ShareGPT, prefix repetition; see
pdserve.perf.workload) are sent as streaming `/v1/completions` (or `/v1/chat/completions`) calls
with max_tokens = the dataset's output length, ignore_eos, temperature 0, and usage in the last
chunk. Their send times follow a Poisson process at --request-rate (gamma inter-arrival times with
shape --burstiness and mean 1/rate; `inf` sends them all at once), at most --max-concurrency in
flight. Several rates make a sweep, run one after the other on the same requests.

Per request, from the client's clock: TTFT = first content chunk - send; ITL = the gaps between
content chunks (a chunk with non-empty choices; for chat, one with delta content, not the role
announcement); e2e latency = last content chunk - send (as vLLM's benchmark_serving measures it);
TPOT = (e2e - TTFT) / (output tokens - 1); output tokens from the usage chunk (else the number of
content chunks). A request fails on an HTTP error, an error chunk, an exception or a stream
without content; its error text is kept and the run goes on.

Per rate, with vLLM's JSON field names (computed in pdserve.perf.metrics): duration (first send
to last completion), completed, failed, token totals, request/output/total-token throughput,
request_goodput (requests meeting every --goodput SLO per second), mean/median/std/percentiles
of TTFT, TPOT, ITL and e2e latency in ms, and per-request lists (ttfts, itls in seconds; null for
a failed request). The table, the JSON form and the plots are in serve_report.py.

Multi-turn (--dataset-name multi-turn): --multi-turn-conversations chats of --multi-turn-turns
turns. A conversation's start follows the --request-rate schedule; its turn k+1 is sent once the
answer to turn k has been read to the end (and, with --multi-turn-think-time T, a seeded
exponential pause of mean T seconds after it), and carries the conversation so far: the system
prompt (if any), every earlier user message and the server's actual answers, then the new message. On
the chat endpoint that is a messages list; on /v1/completions the same history as one text,
"User: ...\nAssistant:" per turn with each answer appended verbatim, so every turn's prompt
starts with the previous turn's prompt and answer (what a prefix cache can reuse). A failed turn
ends its conversation; the turns after it count as failed ("not sent"). --max-concurrency caps
requests in flight (a conversation gives up its slot between turns). The report adds per-turn
aggregates (per_turn: TTFT by turn index, prompt and cached tokens) and, when the server sends
usage.prompt_tokens_details.cached_tokens (any dataset), their total and share of prompt tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable
from urllib.parse import urlparse

import aiohttp
import numpy as np

from ..perf.metrics import RequestResult, compute_metrics, percentile_label
from ..perf.slo import parse_goodput
from ..perf.workload import (Conversation, SampleRequest, add_multi_turn_args, approx_tokens,
                             arrival_times, load_sharegpt, mixed_requests,
                             multi_turn_conversations, prefix_repetition_requests,
                             random_requests)
from .common import git_info, hardware_info, write_result
from .serve_report import (format_per_turn, format_table, import_pyplot, jsonable, plot_runs,
                           rate_label, warn_failures)


# ---- one request -------------------------------------------------------------------------------
@dataclass
class Target:
    """Where and how requests are sent."""
    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = 3600.0
    # --tokenizer's count of a text's tokens: the output of a stream without usage (else its
    # number of content chunks)
    count_tokens: Callable[[str], int] | None = None

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, req: SampleRequest, max_tokens: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if self.model:
            body["model"] = self.model
        if self.chat and req.messages is not None:
            body["messages"] = req.messages
        elif self.chat:
            if not isinstance(req.prompt, str):
                raise ValueError("the chat endpoint needs text prompts (use --no-token-ids)")
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        body.update(max_tokens=max_tokens or req.expected_output_len, temperature=self.temperature,
                    stream=True, stream_options={"include_usage": True})
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


def _error_text(body: str) -> str:
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if err:
            return str(err)
    except (ValueError, AttributeError):
        pass
    return body.strip()[:500]


def _is_content(choice: dict[str, Any], chat: bool) -> bool:
    """Whether a chunk's choice is a token arrival. Completions: every chunk with choices (text
    may be empty: servers without a tokenizer). Chat: a delta with content or reasoning, or an
    empty one mid-stream; not the role announcement nor a bare finish chunk."""
    if not chat:
        return True
    delta = choice.get("delta") or {}
    if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
        return True
    return "role" not in delta and choice.get("finish_reason") is None and "content" in delta


async def send_request(session: aiohttp.ClientSession, target: Target, req: SampleRequest,
                       t0: float = 0.0, max_tokens: int | None = None) -> RequestResult:
    """One streaming request, timed. Never raises (but for cancellation): failures are returned
    with success False and the error text.

    The body is read as raw bytes as they arrive (aiohttp) and split into lines here: every
    event in one read gets that read's time. (httpx's line iterator capped this client at about
    21k events/s against a trivial SSE server on a 2-core machine, aiohttp at about 51k; a client
    at its cap bunches arrivals and inflates TTFT.)"""
    res = RequestResult(req.prompt_len, max_tokens or req.expected_output_len)
    arrivals: list[float] = []
    usage: dict[str, Any] | None = None
    chat = target.chat
    pieces: list[str] = []  # the answer's text
    try:
        payload = target.payload(req, max_tokens)
        st = time.perf_counter()
        res.start = st - t0
        async with session.post(target.url, json=payload, headers=target.headers()) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode(errors="replace")
                res.error = f"HTTP {resp.status}: {_error_text(body)}"
                return res
            tail = b""
            done = False
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                lines = (tail + data).split(b"\n")
                tail = lines.pop()  # an incomplete last line waits for the next read
                for line in lines:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, SSE comments, event: lines
                    payload_bytes = line[5:].strip()
                    if payload_bytes == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload_bytes)
                    if not isinstance(chunk, dict):
                        raise ValueError(f"unexpected chunk {payload_bytes[:200]!r}")
                    if chunk.get("error"):
                        err = chunk["error"]
                        res.error = "error in stream: " + str(
                            err.get("message", err) if isinstance(err, dict) else err)
                        return res
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    choices = chunk.get("choices")
                    if choices and _is_content(choices[0], chat):
                        arrivals.append(now)
                        c = choices[0]
                        piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                        if isinstance(piece, str):
                            pieces.append(piece)
                if done:
                    break
    except aiohttp.ClientConnectorError as e:
        res.error = f"cannot connect to {target.url}: {str(e) or type(e).__name__}"
        res.connect_error = True
        return res
    except asyncio.TimeoutError:
        res.error = f"TimeoutError: no complete answer within {target.timeout_s} s"
        return res
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
        return res
    if not arrivals:
        res.error = "the stream ended without a content chunk"
        return res
    res.success = True
    res.ttft = arrivals[0] - st
    res.itl = [b - a for a, b in zip(arrivals, arrivals[1:])]
    res.latency = arrivals[-1] - st
    n_out = usage.get("completion_tokens") if usage else None
    res.generated_text = "".join(pieces)
    if isinstance(n_out, int):
        res.output_len = n_out
    elif target.count_tokens is not None:
        res.output_len = target.count_tokens(res.generated_text)
    else:
        res.output_len = len(arrivals)
    n_in = usage.get("prompt_tokens") if usage else None
    if isinstance(n_in, int) and n_in > 0:
        res.prompt_len = n_in
    details = usage.get("prompt_tokens_details") if usage else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int) and cached >= 0:
        res.cached_tokens = cached
    return res


def _client(target: Target, max_concurrency: int | None) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, ttl_dns_cache=300,
                                     keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=target.timeout_s)
    # read_bufsize: one read may carry many events when a step feeds every stream at once
    return aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 18,
                                 trust_env=False)


async def run_benchmark(target: Target, requests: list[SampleRequest], rate: float,
                        burstiness: float = 1.0, max_concurrency: int | None = None,
                        seed: int = 0, disable_tqdm: bool = True,
                        desc: str | None = None) -> tuple[list[RequestResult], float]:
    """Send `requests` at arrival_times(rate, burstiness, seed) (a request waiting for a
    --max-concurrency slot is timed from when it gets one); returns the results in request
    order and the duration from the first send to the last completion (s)."""
    offsets = arrival_times(len(requests), rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # A full garbage collection over everything loaded so far (torch, ...) stalls the client for
    # 100+ ms, which would land in some request's TTFT: collect now and keep those objects out of
    # the collections during the run.
    gc.collect()
    gc.freeze()
    try:
        return await _send_all(target, requests, offsets, sem, max_concurrency, disable_tqdm, desc)
    finally:
        gc.unfreeze()


async def _send_all(target: Target, requests: list[SampleRequest], offsets: np.ndarray,
                    sem: asyncio.Semaphore | None, max_concurrency: int | None,
                    disable_tqdm: bool, desc: str | None) -> tuple[list[RequestResult], float]:
    from tqdm import tqdm
    pbar = tqdm(total=len(requests), disable=disable_tqdm, desc=desc, file=sys.stderr)
    async with _client(target, max_concurrency) as client:
        t0 = time.perf_counter()

        async def one(req: SampleRequest) -> RequestResult:
            if sem is None:
                r = await send_request(client, target, req, t0)
            else:
                async with sem:
                    r = await send_request(client, target, req, t0)
            pbar.update(1)
            return r

        tasks = []
        for req, off in zip(requests, offsets):
            while (delay := t0 + float(off) - time.perf_counter()) > 0:
                await asyncio.sleep(delay)  # (the loop's timer may wake a little early)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    pbar.close()
    return results, duration


# ---- multi-turn conversations ------------------------------------------------------------------
class History:
    """A conversation so far, as the next request to send: `next_request(message, n_out)` adds
    the user's message, `add_answer(text)` the server's reply to it."""

    def __init__(self, system: str, chat: bool):
        self.chat = chat
        self.messages: list[dict[str, str]] = \
            [{"role": "system", "content": system}] if system else []
        self.text = system + "\n\n" if system else ""

    def next_request(self, message: str, output_len: int) -> SampleRequest:
        self.messages.append({"role": "user", "content": message})
        self.text += f"User: {message}\nAssistant:"
        return SampleRequest(self.text, approx_tokens(self.text), output_len,
                             messages=list(self.messages) if self.chat else None)

    def add_answer(self, answer: str) -> None:
        self.messages.append({"role": "assistant", "content": answer})
        self.text += answer + "\n"


def first_turn(conv: Conversation, chat: bool) -> SampleRequest:
    return History(conv.system, chat).next_request(conv.user_messages[0], conv.output_lens[0])


async def run_multi_turn(target: Target, convs: list[Conversation], rate: float,
                         burstiness: float = 1.0, max_concurrency: int | None = None,
                         seed: int = 0, disable_tqdm: bool = True,
                         desc: str | None = None) -> tuple[list[RequestResult], float]:
    """Play `convs`: conversation i starts at arrival_times(rate, burstiness, seed)[i], each turn
    after the previous answer (see the module docstring). Returns one result per turn,
    conversation by conversation (conversation i's turn k at i * turns + k for equal turn
    counts), and the duration from the first send to the last completion (s)."""
    offsets = arrival_times(len(convs), rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    gc.collect()  # as in run_benchmark
    gc.freeze()
    try:
        return await _play_all(target, convs, offsets, sem, max_concurrency, disable_tqdm, desc)
    finally:
        gc.unfreeze()


async def _play_all(target: Target, convs: list[Conversation], offsets: np.ndarray,
                    sem: asyncio.Semaphore | None, max_concurrency: int | None,
                    disable_tqdm: bool, desc: str | None) -> tuple[list[RequestResult], float]:
    from tqdm import tqdm
    pbar = tqdm(total=sum(len(c.user_messages) for c in convs), disable=disable_tqdm, desc=desc,
                file=sys.stderr)
    async with _client(target, max_concurrency) as client:
        t0 = time.perf_counter()

        async def play(i: int, conv: Conversation, off: float) -> list[RequestResult]:
            while (delay := t0 + off - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            hist = History(conv.system, target.chat)
            out: list[RequestResult] = []
            for k, (msg, n_out) in enumerate(zip(conv.user_messages, conv.output_lens)):
                if k and conv.think_s and conv.think_s[k] > 0:   # the user reads and types
                    await asyncio.sleep(conv.think_s[k])
                req = hist.next_request(msg, n_out)
                if sem is None:
                    r = await send_request(client, target, req, t0)
                else:
                    async with sem:
                        r = await send_request(client, target, req, t0)
                r.conversation, r.turn = i, k
                out.append(r)
                pbar.update(1)
                if not r.success:
                    for j in range(k + 1, len(conv.user_messages)):
                        out.append(RequestResult(
                            0, conv.output_lens[j], start=r.start, conversation=i, turn=j,
                            error=f"not sent: turn {k} of this conversation failed"))
                        pbar.update(1)
                    break
                hist.add_answer(r.generated_text)
            return out

        tasks = [asyncio.create_task(play(i, c, float(off)))
                 for i, (c, off) in enumerate(zip(convs, offsets))]
        per_conv = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    pbar.close()
    return [r for rs in per_conv for r in rs], duration


async def preflight(target: Target, req: SampleRequest, wait_s: float = 0.0) -> RequestResult:
    """One short request before the run (not counted): checks the endpoint answers and warms it
    up; connection errors are retried for up to wait_s seconds."""
    deadline = time.monotonic() + wait_s
    async with _client(target, 1) as client:
        while True:
            r = await send_request(client, target, req,
                                   max_tokens=min(req.expected_output_len, 8))
            if not r.connect_error or time.monotonic() >= deadline:
                return r
            await asyncio.sleep(1.0)


# ---- command line ------------------------------------------------------------------------------
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
BACKEND_ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions",
                     "openai-chat": "/v1/chat/completions"}


def result_path(a: argparse.Namespace, host: str, now: datetime) -> str:
    """--result-file, else --result-dir / --result-filename with their defaults."""
    if a.result_file:
        return a.result_file
    name = a.result_filename or f"serve-{host}-{now.strftime('%Y%m%d-%H%M%S')}.json"
    return os.path.join(a.result_dir or "bench/results", name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench serve",
        description="Load-test an OpenAI-compatible endpoint: TTFT, TPOT, ITL, e2e latency, "
                    "throughput and goodput at one or more request rates.")
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (else --host/--port)")
    g.add_argument("--host", default="127.0.0.1",
                   help="the server's host when there is no --base-url (default %(default)s)")
    g.add_argument("--port", type=int, default=8000,
                   help="the server's port when there is no --base-url (default %(default)s)")
    g.add_argument("--endpoint", default=None,
                   help="/v1/completions or /v1/chat/completions (default: --backend's)")
    g.add_argument("--backend", default="openai", choices=sorted(BACKEND_ENDPOINTS),
                   help="vLLM's names for the API: openai and vllm send /v1/completions, "
                        "openai-chat /v1/chat/completions (default %(default)s)")
    g.add_argument("--model", default=None, help="model name to send (omitted when not given)")
    g.add_argument("--tokenizer", default=None, metavar="NAME_OR_PATH",
                   help="counts prompt tokens (text datasets; ShareGPT's filters), output tokens "
                        "of a stream without usage, and sets --vocab-size: an HF folder, a .gguf "
                        "file or a repo id in the local Hugging Face cache (vLLM's flag; default: "
                        "none, lengths in approximate tokens)")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=3600.0,
                   help="seconds per request (0: none) (default %(default)s)")
    g.add_argument("--skip-preflight", action="store_true",
                   help="no test request before the run")
    g.add_argument("--ready-check-timeout", type=float, default=0.0,
                   help="keep retrying the test request's connection this many seconds (default "
                        "%(default)s)")
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=1000,
                   help="requests (multi-turn: ignored, conversations x turns) (default "
                        "%(default)s)")
    g.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests per second, one or more (a sweep); inf = all at once (default "
                        "inf)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times (1 = Poisson, < 1 burstier) "
                        "(default %(default)s)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the dataset and the send times (default %(default)s)")
    g = p.add_argument_group("requests")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sent with every request (default %(default)s: greedy)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                   help="send ignore_eos so every request produces max_tokens tokens (off by "
                        "default, as in vLLM's benchmark: a request may end at EOS)")
    g.add_argument("--extra-body", default=None,
                   help="JSON object merged into every request body, e.g. '{\"top_k\": 1}'")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random",
                   choices=["random", "sharegpt", "prefix-repetition", "multi-turn", "mixed"],
                   help="where the requests come from (pdserve/perf/workload.py) (default "
                        "%(default)s)")
    g.add_argument("--dataset-path", default=None, help="sharegpt: the JSON file")
    g.add_argument("--token-ids", action=argparse.BooleanOptionalAction, default=None,
                   help="random/prefix-repetition: send token-id prompts (default: yes for "
                        "completions, no for chat); --no-token-ids sends one word per token")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="random token ids are drawn from [0, N) (default: --tokenizer's "
                        "vocabulary, else 32000)")
    g.add_argument("--random-input-len", type=int, default=1024,
                   help="random: prompt tokens (default %(default)s)")
    g.add_argument("--random-output-len", type=int, default=128,
                   help="random: output tokens asked for (max_tokens) (default %(default)s)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default %(default)s)")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of a prefix shared by every random prompt (default %(default)s)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="output tokens of every ShareGPT request (default: the reference reply's)")
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="prefix-repetition: distinct shared prefixes (default %(default)s)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                   help="prefix-repetition: tokens of each prefix (default %(default)s)")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                   help="prefix-repetition: tokens of each request's own suffix (default "
                        "%(default)s)")
    g.add_argument("--prefix-repetition-output-len", type=int, default=128,
                   help="prefix-repetition: output tokens asked for (default %(default)s)")
    g.add_argument("--mixed-long-share", type=float, default=0.2,
                   help="mixed: the share of long-document requests among short chat turns "
                        "(default %(default)s)")
    g.add_argument("--mixed-short-input-len", type=int, default=256,
                   help="mixed: prompt tokens of a short chat turn (default %(default)s)")
    g.add_argument("--mixed-short-output-len", type=int, default=128,
                   help="mixed: output tokens of a short chat turn (default %(default)s)")
    g.add_argument("--mixed-long-input-len", type=int, default=4096,
                   help="mixed: prompt tokens of a long document (default %(default)s)")
    g.add_argument("--mixed-long-output-len", type=int, default=128,
                   help="mixed: lengths vary by --random-range-ratio (default %(default)s)")
    add_multi_turn_args(g)
    g = p.add_argument_group("output")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs a request must all meet to count for goodput: ttft:MS tpot:MS "
                        "e2el:MS")
    g.add_argument("--metric-percentiles", default="50,90,99",
                   help="comma-separated percentiles to report (default %(default)s)")
    g.add_argument("--percentile-metrics", default=",".join(PERCENTILE_METRICS),
                   help="comma-separated metrics whose percentiles are reported, of "
                        f"{', '.join(PERCENTILE_METRICS)} (vLLM's flag; its default leaves "
                        "e2el out)")
    g.add_argument("--result-file", default=None,
                   help="default: RESULT_DIR/RESULT_FILENAME, RESULT_DIR "
                        "bench/results/, RESULT_FILENAME serve-<host>-<timestamp>.json")
    g.add_argument("--save-result", action="store_true",
                   help="vLLM's flag, accepted: the result is always written")
    g.add_argument("--result-dir", default=None, help="the result's folder (vLLM's flag)")
    g.add_argument("--result-filename", default=None, help="the result's file name (vLLM's flag)")
    g.add_argument("--plot", default=None, metavar="PATH.png",
                   help="latency CDFs and, for a sweep, throughput/latency vs rate (matplotlib)")
    g.add_argument("--disable-tqdm", action="store_true",
                   help="no progress bar")
    return p


def build_requests(a: argparse.Namespace, chat: bool, tokenizer=None) -> list[SampleRequest]:
    """The dataset's requests; with a tokenizer, a text prompt's length is its token count
    (as the server counts a completion prompt; else approximate)."""
    requests = _dataset_requests(a, chat, tokenizer)
    if tokenizer is not None:
        for r in requests:
            if isinstance(r.prompt, str):
                r.prompt_len = len(tokenizer.encode(r.prompt))
    return requests


def _dataset_requests(a: argparse.Namespace, chat: bool, tokenizer) -> list[SampleRequest]:
    token_ids = (not chat) if a.token_ids is None else a.token_ids
    if chat and token_ids:
        raise ValueError("the chat endpoint takes text; drop --token-ids")
    if a.dataset_name == "random":
        return random_requests(a.num_prompts, a.random_input_len, a.random_output_len,
                               a.random_range_ratio, a.random_prefix_len, a.vocab_size, a.seed,
                               token_ids)
    if a.dataset_name == "mixed":
        return mixed_requests(a.num_prompts, a.mixed_long_share, a.mixed_short_input_len,
                              a.mixed_short_output_len, a.mixed_long_input_len,
                              a.mixed_long_output_len, a.random_range_ratio, a.vocab_size,
                              a.seed, token_ids)
    if a.dataset_name == "prefix-repetition":
        return prefix_repetition_requests(
            a.num_prompts, a.prefix_repetition_num_prefixes, a.prefix_repetition_prefix_len,
            a.prefix_repetition_suffix_len, a.prefix_repetition_output_len, a.vocab_size, a.seed,
            token_ids)
    if not a.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (make one with "
                         "python -m pdserve.bench.datasets make-sharegpt OUT.json)")
    count = approx_tokens if tokenizer is None else (
        lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    return load_sharegpt(a.dataset_path, a.num_prompts, a.seed, a.sharegpt_output_len,
                         count=count)


def build_conversations(a: argparse.Namespace) -> list[Conversation]:
    if a.token_ids:
        raise ValueError("--dataset-name multi-turn sends text (the history holds the server's "
                         "answers); drop --token-ids")
    return multi_turn_conversations(a.multi_turn_conversations, a.multi_turn_turns,
                                    a.multi_turn_user_len, a.multi_turn_output_len,
                                    a.multi_turn_range_ratio, a.multi_turn_system_len,
                                    a.vocab_size, a.seed, a.multi_turn_think_time)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser()
    a = p.parse_args(argv)
    try:
        percentiles = [float(x) for x in a.metric_percentiles.split(",") if x.strip()]
        if any(not 0 <= x <= 100 for x in percentiles):
            raise ValueError
    except ValueError:
        p.error(f"--metric-percentiles: comma-separated numbers in [0, 100], got {a.metric_percentiles!r}")
    chosen = [x.strip() for x in a.percentile_metrics.split(",") if x.strip()]
    if not chosen or any(x not in PERCENTILE_METRICS for x in chosen):
        p.error(f"--percentile-metrics: comma-separated names of {', '.join(PERCENTILE_METRICS)}"
                f", got {a.percentile_metrics!r}")
    dropped = [f"p{percentile_label(q)}_{m}_ms" for m in PERCENTILE_METRICS if m not in chosen
               for q in percentiles]
    try:
        slos = parse_goodput(a.goodput)
    except ValueError as e:
        p.error(str(e))
    if any(not r > 0 for r in a.request_rate):
        p.error("--request-rate values must be > 0 (inf for all at once)")
    if not a.burstiness > 0:
        p.error("--burstiness must be > 0")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    try:
        extra = json.loads(a.extra_body) if a.extra_body else {}
        if not isinstance(extra, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        p.error(f"--extra-body: {e}")
    if a.plot:
        try:
            import_pyplot()
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if a.result_file and (a.result_dir or a.result_filename):
        p.error("--result-file or --result-dir/--result-filename, not both")
    if a.endpoint is None:
        a.endpoint = BACKEND_ENDPOINTS[a.backend]
    tokenizer = count_tokens = None
    if a.tokenizer is not None:
        from ..loader.tokenizer import tokenizer_from_spec
        try:
            tokenizer = tokenizer_from_spec(a.tokenizer)
        except (ValueError, OSError) as e:
            print(f"error: --tokenizer: {e}", file=sys.stderr)
            return 2

        def count_tokens(text: str) -> int:   # (an answer's tokens: no BOS, as vLLM counts)
            return len(tokenizer.encode(text, add_special_tokens=False))
    if a.vocab_size is None:
        a.vocab_size = tokenizer.vocab_size if tokenizer is not None else 32000
    base_url = a.base_url or f"http://{a.host}:{a.port}"
    if not urlparse(base_url).scheme:
        base_url = "http://" + base_url
    target = Target(base_url, a.endpoint, a.model, a.api_key or os.environ.get("OPENAI_API_KEY"),
                    a.temperature, a.ignore_eos, extra, a.request_timeout or None, count_tokens)
    multi = a.dataset_name == "multi-turn"
    convs: list[Conversation] = []
    try:
        if multi:
            convs = build_conversations(a)
            requests = [first_turn(convs[0], target.chat)]  # for the preflight
        else:
            requests = build_requests(a, target.chat, tokenizer)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not requests:
        print("error: the dataset produced no requests (--num-prompts?)", file=sys.stderr)
        return 2

    if not a.skip_preflight:
        r = asyncio.run(preflight(target, requests[0], a.ready_check_timeout))
        if not r.success:
            hint = " (is the server running?)" if r.connect_error else ""
            print(f"error: the test request to {target.url} failed: {r.error}{hint}",
                  file=sys.stderr)
            return 1

    if multi:
        n_req = sum(len(c.user_messages) for c in convs)
        n_out = sum(sum(c.output_lens) for c in convs)
        what = (f"{len(convs)} conversations x {a.multi_turn_turns} turns ({n_req} requests, "
                f"{n_out} output tokens, prompts growing with the answers; "
                f"{'messages' if target.chat else 'concatenated text'})")
        rate_of = "conversation starts/s"
    else:
        n_req = len(requests)
        n_in = sum(r.prompt_len for r in requests)
        n_out = sum(r.expected_output_len for r in requests)
        what = f"{n_req} {a.dataset_name} requests ({n_in} prompt / {n_out} output tokens)"
        rate_of = "req/s"
    print(f"pdserve bench serve: {what} to {target.url}; rates "
          f"{', '.join(rate_label(x) for x in a.request_rate)} {rate_of}, burstiness "
          f"{a.burstiness:g}, max concurrency {a.max_concurrency or 'unlimited'}", flush=True)
    runs = []
    for rate in a.request_rate:
        if multi:
            results, duration = asyncio.run(run_multi_turn(
                target, convs, rate, a.burstiness, a.max_concurrency, a.seed, a.disable_tqdm,
                desc=f"rate {rate_label(rate)}"))
        else:
            results, duration = asyncio.run(run_benchmark(
                target, requests, rate, a.burstiness, a.max_concurrency, a.seed, a.disable_tqdm,
                desc=f"rate {rate_label(rate)}"))
        m = compute_metrics(results, duration, percentiles, slos)
        for key in dropped:
            m.pop(key, None)
        run = {"request_rate": rate_label(rate), "burstiness": a.burstiness,
               "max_concurrency": a.max_concurrency, "num_prompts": n_req, **m}
        if multi:
            run.update(num_conversations=len(convs), turns=a.multi_turn_turns)
        runs.append(run)
        warn_failures(run)

    payload: dict[str, Any] = {
        "benchmark": "serve", "date": datetime.now().isoformat(timespec="seconds"),
        "base_url": base_url, "endpoint": a.endpoint, "model_id": a.model,
        "dataset_name": a.dataset_name, "percentiles": percentiles, "runs": runs}
    if len(runs) == 1:  # a single run's metrics also at the top level, as vLLM writes them
        payload.update({k: v for k, v in runs[0].items() if k not in payload})
    payload.update(command=["pdserve", "bench", "serve", *argv], config=vars(a),
                   hardware=hardware_info(), **git_info())
    host = (urlparse(base_url).hostname or "local").replace(":", "_")
    out = result_path(a, host, datetime.now())
    print(format_table(runs, percentiles))
    for run in runs:
        extra = format_per_turn(run)
        if extra:
            print(extra)
    print("wrote", write_result(out, jsonable(payload)))
    if a.plot:
        print("plot", plot_runs(runs, a.plot, percentiles))
    if not any(r["completed"] for r in runs):
        print("error: no request completed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
