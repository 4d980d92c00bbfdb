"""Types that cross module and process boundaries: what a client asks of an engine or worker
(AddRequest), what moves between a P/D producer and consumer (KVPeer, KVPair, KVSource, KVLoad,
KVLoadDone, KVSend, KVDrop) and what a worker reports about itself (WorkerStats).

Neutral ground: this module imports nothing of pdserve but SamplingParams, so the engine core,
the workers, the connectors, the router and the server all share one definition of each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from .sampling_params import SamplingParams

Prompt = str | dict | list[int]


@dataclass(frozen=True)
class AddRequest:
    """One request for add_requests() (and, over messages, for a worker process)."""
    request_id: str
    prompt: Any                      # str, {"prompt_token_ids": [...]} / {"prompt": str}, list[int]
    params: SamplingParams
    final_only: bool = False
    arrival_time: float | None = None
    kv_hold: bool = False            # P/D producer: keep the KV when finished (output.kv_transfer)
    kv_source: KVSource | None = None  # P/D consumer: pull the prompt's KV from a producer


class KVPeer(msgspec.Struct, tag=True):
    """A producer worker's KV pools as a consumer needs them to pull from: one opaque handle per
    rank (connector-specific), its TP size and the model's KV head count."""
    worker: str
    connector: str
    tp: int
    num_kv_heads: int
    handles: list[bytes]


class KVSource(msgspec.Struct):
    """Where a request's prompt KV waits: on producer `worker`, held under `request_id`, in
    `block_ids` (table order), covering the first `num_tokens` positions. `output_token_ids`
    are the tokens the producer already sampled (their KV is not computed yet).
    worker "" (and no blocks): the KV is lost (its producer died); the consumer recomputes the
    prompt and continues after output_token_ids all the same.

    skip_blocks (two-sided connectors only; one-sided consumers match their own cache): the
    leading whole blocks the router believes the consumer has cached (its prefix index), so
    the producer sends only block_ids[skip_blocks:] (sent_block_ids) and the consumer receives
    exactly those. Always fewer than len(block_ids): the last block is always sent.

        block_ids   [b0 b1 b2 | b3 b4]      skip_blocks 3: b3, b4 travel; the consumer reuses
                     cached     sent        its own cached blocks for positions [0, 3 * bs)
    """
    worker: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    output_token_ids: list[int]
    skip_blocks: int = 0

    @property
    def lost(self) -> bool:
        return not self.worker

    @property
    def sent_block_ids(self) -> list[int]:
        """The blocks a two-sided producer sends (those past skip_blocks)."""
        return self.block_ids[self.skip_blocks:]

    def without_kv(self) -> "KVSource":
        """The same continuation with its KV lost (recomputed where it lands)."""
        return msgspec.structs.replace(self, worker="", block_ids=[], skip_blocks=0)


class KVLoad(NamedTuple):
    """Consumer side: copy `src_block_ids` of `worker` into `dst_block_ids` here (every layer)."""
    request_id: str
    worker: str
    src_block_ids: list[int]
    dst_block_ids: list[int]


class KVLoadDone(msgspec.Struct, array_like=True):
    """A consumer's report on one load: ok, bytes moved on rank 0, seconds from start to done."""
    request_id: str
    ok: bool
    nbytes: int
    seconds: float
    error: str | None = None


class KVPair(msgspec.Struct, tag=True):
    """A producer/consumer pair for a two-sided connector: both sides' ranks form one process
    group (producer ranks first), meeting at `store` ("host:port", a TCPStore the router hosts)
    under the prefix "producer->consumer". `side` says which end the receiving worker is."""
    producer: str
    consumer: str
    producer_tp: int
    consumer_tp: int
    num_kv_heads: int
    store: str
    side: str                      # "producer" | "consumer"
    # The producer abandons a send that has not completed this long after it could start (the
    # pair's previous send done): the consumer is dead or stuck. The pair is then broken (later
    # sends to it are skipped; the consumer's loads from it fail and are recomputed). Set by
    # whoever pairs the workers, above the consumer's kv_transfer_timeout_s (by then the
    # consumer has given up on that load anyway).
    send_timeout_s: float = 60.0


class KVDrop(msgspec.Struct, tag=True):
    """A peer worker is gone (the router saw it die): abort the pair with it now, instead of
    waiting for a transfer to time out. Travels to every rank with the step, like a KVPeer."""
    worker: str


class KVSend(msgspec.Struct, array_like=True):
    """Producer side of a two-sided transfer: send these held blocks of `request_id` to
    `consumer` (its ranks receive them in the order the sends were asked for)."""
    request_id: str
    consumer: str
    block_ids: list[int]
    ok: bool = True                # False: the blocks were no longer held (data is filler)


class WorkerStats(msgspec.Struct):
    """The worker's state after a step (for metrics and, later, load-aware routing)."""
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int        # held by requests (blocks only the prefix cache holds count as free)
    num_kv_blocks: int
    num_preemptions: int
    kv_peers: int = 0   # P/D: peers this worker's connector has joined (or given up on)
    kv_broken: int = 0  # P/D, two-sided: pairs among kv_peers that broke (or were dropped)
    prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0      # of them, found cached
    prefix_cache_blocks: int = 0    # blocks listed by the prefix cache now
    # the KV cache's host tier (swap_space_gb): its size and use now, and totals since start
    num_host_blocks: int = 0
    num_host_blocks_used: int = 0   # held by swapped-out requests or prefixes cached there
    blocks_swapped_out: int = 0     # swap preemption, blocks copied to the host
    blocks_swapped_in: int = 0      # and back
    blocks_offloaded: int = 0       # prefix cache: evicted device blocks kept on the host
    blocks_loaded_back: int = 0     # and copied back for a match
    prefix_host_hits: int = 0       # prompt tokens matched on the host (also in prefix_cache_hits)


class StepRecord(msgspec.Struct, array_like=True):
    """One engine step as its worker saw it: what ran (tokens and sequences, split into prefill
    and decode), how long the step took on the host (wall_ms: schedule + forward + update, with
    the device synchronised by the sampled tokens' copy) and on the device (gpu_ms: CUDA events
    around the forward, logits and sampling; None on CPU or when not measured). `t` is
    time.monotonic() at the step's end, on the worker's clock. The cost model and the router's
    load view are built from these."""
    t: float
    num_prefill_tokens: int        # prompt (or recomputed) tokens fed this step
    num_decode_tokens: int         # one per decoding sequence
    num_prefill_seqs: int
    num_decode_seqs: int
    num_waiting: int               # queued after the step (not admitted)
    wall_ms: float
    gpu_ms: float | None = None


def parse_prompt(prompt: Any, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """What a prompt may be, checked in one place (the engine and the router both call it):
    a non-empty string (tokenized with `tokenizer`), a list of token ids, or a dict with
    "prompt_token_ids" (and optionally the "prompt" text it came from, kept for the output)
    or with only "prompt". Returns (text or None, token ids); ValueError for anything else,
    an empty prompt or an id outside [0, vocab_size)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True); "
                             "pass {'prompt_token_ids': [...]}")
        if not prompt:
            raise ValueError("prompt is empty")
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            if "prompt" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
            return parse_prompt(prompt["prompt"], tokenizer, vocab_size)
        ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError("prompt must be a string")
    else:
        ids, text = prompt, None
    # (plain ints checked in C, the usual case; other types one by one)
    if not isinstance(ids, (list, tuple)) or not (set(map(type, ids)) <= {int} or all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise ValueError("prompt_token_ids must be a list of integers")
    if not ids:
        raise ValueError("prompt is empty (no tokens)")
    check_token_ids("prompt", ids, vocab_size)
    return text, list(ids)


def check_token_ids(what: str, ids, vocab_size: int) -> None:
    if not ids or (0 <= min(ids) and max(ids) < vocab_size):   # (the usual case, in C)
        return
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ValueError(f"{what}: token id {t} is outside the vocabulary [0, {vocab_size})")


def kv_transfer_unsupported(params: SamplingParams) -> str | None:
    """Why a request's KV cannot move between workers (None: it can). One source for the rule
    the router's policies obey and the engine checks on a kv_source: a hand-off carries one
    sequence's KV and the producer's sampled tokens, so no n > 1 (forked sequences) and no
    prompt_logprobs (the consumer never computes the prompt's logits)."""
    if params.n != 1 or params.prompt_logprobs is not None:
        return "a P/D request needs n=1 and no prompt_logprobs"
    return None
