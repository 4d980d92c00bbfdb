"""Workloads: when requests arrive and what they ask for, deterministic in a seed. Plain Python
and numpy (no torch, no HTTP client), so the benchmarks, a router and a simulator share it.

Arrivals: `arrival_times` -- a Poisson process at a rate, or gamma inter-arrival times with a
shape (burstiness) for burstier or more regular traffic.

Requests: each generator yields SampleRequests (a prompt, its length in tokens, and the number of
tokens to ask for):

    random             random token ids; input/output lengths uniform in [len*(1-r), len*(1+r)],
                       optionally after a prefix shared by every request
    sharegpt           the first human turn and the first reply of each conversation in a
                       ShareGPT-format JSON file (lengths in approximate tokens, see approx_tokens)
    prefix-repetition  a few long prefixes, each shared by many requests with their own suffix

and `multi_turn_conversations` yields Conversations (an optional system prompt shared by all,
then one new user message per turn) for a client that sends turn k+1 after turn k's answer.

Token-id prompts suit servers without a tokenizer (dummy weights). With token_ids=False the ids
become words from a small list of common English words (about one token each for a BPE
tokenizer), so the lengths are approximate on the server's side.

`make_sharegpt` builds a synthetic ShareGPT-format dataset (the real one cannot be downloaded
everywhere; `python -m pdserve.bench.datasets make-sharegpt` writes one); a share of its entries
is built to be dropped by the loader's filters.
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

# ---- requests ----------------------------------------------------------------------------------
# Common short English words: each is about one token for BPE tokenizers when preceded by a space.
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than first water "
    "been call who oil its now find long down day did get come made may part over new sound take "
    "only little work know place year live me back give most very after thing our just name good "
    "sentence man think say great where help through much before line right too mean old any same "
    "tell boy follow came want show also around form three small set put end does another well "
    "large must big even such because turn here why ask went men read need land different home us "
    "move try kind hand picture again change off play spell air away animal house point page "
    "letter mother answer found study still learn should world high every near add food between "
    "own below country plant last school father keep tree never start city earth eye light thought"
).split()


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int           # tokens (exact for token-id prompts, approximate for text)
    expected_output_len: int  # the request's max_tokens
    group: int | None = None  # prefix-repetition: which prefix it shares; mixed: 0 short, 1 long
    # chat: the whole message list to send (multi-turn); None sends prompt as one user message
    messages: list[dict[str, str]] | None = None


@dataclass
class Conversation:
    """A multi-turn chat to play against a server: the user's messages, one per turn, and the
    answer length to ask for after each; the answers come from the server while it is played."""
    system: str                # "" for none
    user_messages: list[str]
    output_lens: list[int]
    user_lens: list[int]       # tokens of each user message (one word per token)
    # seconds the user waits after an answer before sending turn k (turn 0: 0); empty: none
    think_s: list[float] = field(default_factory=list)


def ids_to_text(ids: list[int]) -> str:
    """One word per token id (id modulo the word list)."""
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


def approx_tokens(text: str) -> int:
    """Token count without a tokenizer: the larger of the whitespace word count and
    characters / 4 (English BPE averages ~4 characters and ~0.75 words per token)."""
    return max(len(text.split()), len(text) // 4)


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] of lengths uniform around `length` with range ratio r:
    [int(length*(1-r)), int(length*(1+r))], low at least 1."""
    if not 0 <= ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {ratio}")
    low = max(1, int(length * (1 - ratio)))
    high = max(low, int(length * (1 + ratio)))
    return low, high


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    prefix_len: int = 0, vocab_size: int = 32000, seed: int = 0,
                    token_ids: bool = True) -> list[SampleRequest]:
    """`num` requests of random token ids: a prefix of `prefix_len` ids shared by all, then
    input lengths uniform (integers, inclusive) in length_range(input_len, range_ratio); output
    lengths likewise around output_len. prompt_len counts the prefix."""
    if num < 0 or input_len < 1 or output_len < 1 or prefix_len < 0 or vocab_size < 1:
        raise ValueError("random dataset: need num >= 0, input/output len >= 1, prefix len >= 0, "
                         "vocab size >= 1")
    rng = np.random.default_rng(seed)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num)
    prefix = rng.integers(0, vocab_size, size=prefix_len).tolist()
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = prefix + rng.integers(0, vocab_size, size=int(n_in)).tolist()
        out.append(SampleRequest(ids if token_ids else ids_to_text(ids), len(ids), int(n_out)))
    return out


def mixed_requests(num: int, long_share: float, short_input_len: int, short_output_len: int,
                   long_input_len: int, long_output_len: int, range_ratio: float = 0.0,
                   vocab_size: int = 32000, seed: int = 0,
                   token_ids: bool = True) -> list[SampleRequest]:
    """`num` requests of two kinds in one stream: short chat turns (input and output lengths
    around short_input_len / short_output_len) and, each request with probability long_share,
    long documents (around long_input_len / long_output_len: a summary of a long prompt), in a
    seeded random order; lengths uniform in length_range(len, range_ratio). group: 0 short,
    1 long. The workload on which a per-request router's choice matters: a long prompt
    collocated with decoding chat turns stalls them, split it pays a KV transfer."""
    if not 0 <= long_share <= 1:
        raise ValueError(f"mixed dataset: the long share must be in [0, 1], got {long_share}")
    if num < 0 or min(short_input_len, short_output_len, long_input_len, long_output_len) < 1:
        raise ValueError("mixed dataset: need num >= 0 and every length >= 1")
    rng = np.random.default_rng(seed)
    kinds = rng.random(num) < long_share
    out = []
    for long in kinds:
        n_in, n_out = (long_input_len, long_output_len) if long else (short_input_len, short_output_len)
        lo, hi = length_range(n_in, range_ratio)
        olo, ohi = length_range(n_out, range_ratio)
        ids = rng.integers(0, vocab_size, size=int(rng.integers(lo, hi + 1))).tolist()
        out.append(SampleRequest(ids if token_ids else ids_to_text(ids), len(ids),
                                 int(rng.integers(olo, ohi + 1)), int(long)))
    return out


def prefix_repetition_requests(num: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                               output_len: int, vocab_size: int = 32000, seed: int = 0,
                               token_ids: bool = True) -> list[SampleRequest]:
    """`num` requests, each one of `num_prefixes` random prefixes (prefix_len ids) followed by
    its own random suffix (suffix_len ids); the prefixes are dealt round robin (group sizes
    differ by at most one) and the requests shuffled."""
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1:
        raise ValueError("prefix-repetition: need >= 1 prefix and prefix + suffix len >= 1")
    if output_len < 1:
        raise ValueError("prefix-repetition: output len must be >= 1")
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab_size, size=prefix_len).tolist() for _ in range(num_prefixes)]
    out = []
    for i in range(num):
        g = i % num_prefixes
        ids = prefixes[g] + rng.integers(0, vocab_size, size=suffix_len).tolist()
        out.append(SampleRequest(ids if token_ids else ids_to_text(ids), len(ids), output_len, g))
    order = rng.permutation(num)
    return [out[i] for i in order]


def add_multi_turn_args(group) -> None:
    """The multi-turn dataset's flags (bench serve's and simulate's): multi_turn_conversations'
    arguments."""
    group.add_argument("--multi-turn-conversations", type=int, default=64,
                       help="multi-turn: conversations (their starts follow --request-rate) "
                            "(default %(default)s)")
    group.add_argument("--multi-turn-turns", type=int, default=6,
                       help="multi-turn: turns each (default %(default)s)")
    group.add_argument("--multi-turn-user-len", type=int, default=128,
                       help="multi-turn: tokens (words) of each new user message (default "
                            "%(default)s)")
    group.add_argument("--multi-turn-output-len", type=int, default=128,
                       help="multi-turn: answer tokens asked for per turn (default %(default)s)")
    group.add_argument("--multi-turn-range-ratio", type=float, default=0.0,
                       help="multi-turn: user/answer lengths uniform in [len*(1-r), len*(1+r)] "
                            "(default %(default)s)")
    group.add_argument("--multi-turn-system-len", type=int, default=0,
                       help="multi-turn: tokens (words) of a system prompt shared by all "
                            "conversations (default %(default)s)")
    group.add_argument("--multi-turn-think-time", type=float, default=0.0,
                       help="multi-turn: mean seconds a user takes after an answer before the "
                            "next turn, exponential and seeded (default %(default)s: at once)")


def multi_turn_conversations(num: int, turns: int, user_len: int, output_len: int,
                             range_ratio: float = 0.0, system_len: int = 0,
                             vocab_size: int = 32000, seed: int = 0,
                             think_time: float = 0.0) -> list[Conversation]:
    """`num` conversations of `turns` turns: each user message is random words (one per token,
    ids_to_text), its length uniform in length_range(user_len, range_ratio), each answer's length
    likewise around output_len; a system prompt of `system_len` words is shared by all of them.
    Text only: later turns carry the server's answers, which are text. With think_time > 0 the
    user pauses before each turn after the first, exponentially with that mean (s), from a
    stream of its own: the messages and lengths are those of think_time 0 for the same seed.
    A chat's users read and type between turns; without the pause a conversation's history is
    only ever one answer old, which keeps the live histories few."""
    if num < 1 or turns < 1:
        raise ValueError(f"multi-turn: need >= 1 conversation and >= 1 turn, got {num} "
                         f"conversations x {turns} turns")
    if user_len < 1 or output_len < 1 or system_len < 0 or vocab_size < 1:
        raise ValueError("multi-turn: need user and output len >= 1, system len >= 0, "
                         "vocab size >= 1")
    if not (math.isfinite(think_time) and think_time >= 0):
        raise ValueError(f"multi-turn: think time must be a finite number of seconds >= 0, "
                         f"got {think_time!r}")
    think_rng = np.random.default_rng([seed, 0x7417])
    rng = np.random.default_rng([seed, 0x3D7])
    u_lo, u_hi = length_range(user_len, range_ratio)
    o_lo, o_hi = length_range(output_len, range_ratio)
    system = ids_to_text(rng.integers(0, vocab_size, size=system_len).tolist())
    out = []
    for _ in range(num):
        u_lens = rng.integers(u_lo, u_hi + 1, size=turns).tolist()
        o_lens = rng.integers(o_lo, o_hi + 1, size=turns).tolist()
        msgs = [ids_to_text(rng.integers(0, vocab_size, size=n).tolist()) for n in u_lens]
        think = [0.0] * turns
        if think_time > 0:
            think[1:] = think_rng.exponential(think_time, size=turns - 1).tolist()
        out.append(Conversation(system, msgs, o_lens, u_lens, think))
    return out


def sharegpt_pairs(data: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(first human turn, the reply after it) of each entry with at least two turns."""
    pairs = []
    for entry in data:
        conv = entry.get("conversations") or entry.get("conversation") or []
        if len(conv) < 2:
            continue
        prompt, reply = conv[0].get("value"), conv[1].get("value")
        if isinstance(prompt, str) and isinstance(reply, str):
            pairs.append((prompt, reply))
    return pairs


def sharegpt_valid(prompt_len: int, output_len: int, check_min_output: bool = True,
                   min_len: int = 4, max_prompt_len: int = 1024, max_total_len: int = 2048) -> bool:
    """The usual ShareGPT filters: prompt (and reference output) at least min_len tokens, prompt
    at most max_prompt_len, prompt + output at most max_total_len."""
    if prompt_len < min_len or (check_min_output and output_len < min_len):
        return False
    return prompt_len <= max_prompt_len and prompt_len + output_len <= max_total_len


def load_sharegpt(path: str | os.PathLike, num: int, seed: int = 0,
                  output_len: int | None = None, oversample: bool = True,
                  count: Callable[[str], int] = approx_tokens) -> list[SampleRequest]:
    """`num` requests from a ShareGPT-format file: the entries shuffled with the seed, each
    (prompt, reply) measured with `count` (approx_tokens, or a tokenizer's count), filtered
    with sharegpt_valid (output length = the reply's, or `output_len` when given), the first
    `num` kept. Fewer valid entries than `num`: some are repeated (chosen with the seed) unless
    oversample is False."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = sharegpt_pairs(data)
    rng = np.random.default_rng(seed)
    out: list[SampleRequest] = []
    for i in rng.permutation(len(pairs)):
        prompt, reply = pairs[i]
        p_len = count(prompt)
        o_len = count(reply) if output_len is None else output_len
        if not sharegpt_valid(p_len, o_len, check_min_output=output_len is None):
            continue
        out.append(SampleRequest(prompt, p_len, o_len))
        if len(out) == num:
            break
    if not out and num > 0:
        raise ValueError(f"{path}: no conversation passes the ShareGPT filters")
    if len(out) < num:
        if not oversample:
            print(f"warning: {path} has only {len(out)} usable conversations (asked for {num})",
                  file=sys.stderr)
        else:
            extra = rng.integers(0, len(out), size=num - len(out))
            print(f"warning: {path} has only {len(out)} usable conversations; repeating "
                  f"{num - len(out)} of them to make {num}", file=sys.stderr)
            out += [out[i] for i in extra]
    return out


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=n))


def make_sharegpt(num: int, seed: int = 0) -> list[dict[str, Any]]:
    """A synthetic ShareGPT-format dataset of `num` conversations: mostly 2-4 turns with prompt
    and reply lengths spread from a few words to thousands; about one in eight entries is meant
    to fail a filter (single turn, a 2-word prompt or reply, a prompt over 1024 tokens, or prompt
    + reply over 2048)."""
    rng = np.random.default_rng(seed)
    data = []
    for i in range(num):
        kind = rng.integers(0, 16)
        p_words = int(np.clip(rng.lognormal(4.0, 1.0), 4, 700))
        r_words = int(np.clip(rng.lognormal(4.8, 0.8), 4, 900))
        if kind == 0:
            p_words = 2
        elif kind == 1:
            r_words = 2
        elif kind == 2:
            p_words = int(rng.integers(1100, 1500))
        elif kind == 3:
            p_words, r_words = int(rng.integers(600, 1000)), int(rng.integers(1300, 1800))
        turns = [{"from": "human", "value": _words(rng, p_words)}]
        if kind != 4:  # kind 4: a conversation with only the human turn
            turns.append({"from": "gpt", "value": _words(rng, r_words)})
            for t in range(int(rng.integers(0, 3))):
                turns.append({"from": "human" if t % 2 == 0 else "gpt",
                              "value": _words(rng, int(rng.integers(4, 60)))})
        data.append({"id": f"synthetic-{seed}-{i}", "conversations": turns})
    return data


# ---- arrivals ----------------------------------------------------------------------------------
def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send offsets in seconds from the start of a run: the first request at 0, then gaps drawn
    from a gamma distribution with shape = burstiness and mean 1/rate (burstiness 1: exponential,
    i.e. a Poisson process; < 1 burstier, > 1 more regular; variance 1/(rate^2 * burstiness)).
    rate = inf: everything at 0. Deterministic in the seed."""
    if num <= 0:
        return np.zeros(0)
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(num)
    rng = np.random.default_rng([seed, 0xA441])  # a stream of its own, apart from the dataset's
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
