"""Token sampler: penalties, temperature, min-p / top-k / top-p filtering, seeded sampling, logprobs.

Design
------
* ``SamplingBatch.build`` is the one place where per-request ``SamplingParams`` become tensors. All
  host-side decisions (which stages any row needs, which rows own a generator, the largest top-k,
  how many top logprobs to return) are made there, as Python values, so that ``Sampler.__call__``
  launches a fixed, data-independent sequence of kernels and never reads a device value back.
* Everything is vectorised over the batch; the only Python loop over rows is the one drawing noise
  from per-request generators.
* Sampling uses the exponential-race (Gumbel-max) trick: ``token = argmax(probs / q)`` with
  ``q ~ Exp(1)`` i.i.d. per vocabulary entry. A row with its own generator draws its ``[V]`` noise
  vector from that generator only, so a seeded request gives the same tokens alone or in any batch.
* Returned logprobs are the *raw* model distribution: ``log_softmax(logits)`` in float32, before
  penalties and temperature (vLLM's default "raw_logprobs" mode).

Processing order (vLLM / HF semantics)::

    raw logprobs  <- log_softmax(logits)
    token bitmask -> structured outputs: tokens the row's grammar does not allow get -inf
    logit_bias    -> logit[token] += bias, per row (OpenAI's logit_bias)
    min_tokens    -> ban EOS / stop_token_ids while len(output) < min_tokens   (optional, see build)
    repetition    -> over prompt ∪ output tokens: logit > 0 ? logit / p : logit * p
    freq/presence -> over output tokens: logit -= freq * count + presence * (count > 0)
    greedy rows   -> argmax of the penalised logits
    random rows   -> / temperature, min-p, top-k, top-p, exponential-race sample
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from pdserve.sampling_params import SamplingParams

__all__ = ["SamplingBatch", "SamplerOutput", "Sampler", "apply_logit_bias", "apply_penalties",
           "apply_token_bans", "apply_token_bitmask"]

_NEG_INF = float("-inf")
_TINY = torch.finfo(torch.float32).tiny


# =================================================================================================
# Batch tensors
# =================================================================================================
@dataclass
class SamplingBatch:
    """Per-step sampling state of a batch of B rows over a vocabulary of V tokens.

    In the all-greedy fast path (no penalties, bans or logprobs) the tensor fields are None: only
    an argmax reads the batch. Otherwise greedy rows get neutral random-path values (temperature 1, top_k V, top_p 1, min_p 0) so that
    the ``any_*`` flags describe only the rows that actually sample, and no division by zero happens
    on the (discarded) random path of a greedy row.
    """
    temperature: Tensor            # [B] float32 (1.0 on greedy rows)
    top_k: Tensor                  # [B] int64 (V when disabled)
    top_p: Tensor                  # [B] float32
    min_p: Tensor                  # [B] float32
    presence: Tensor               # [B] float32
    frequency: Tensor              # [B] float32
    repetition: Tensor             # [B] float32
    greedy_mask: Tensor            # [B] bool
    all_greedy: bool
    all_random: bool
    any_penalty: bool              # any of the three penalties on any row
    any_repetition: bool           # repetition_penalty != 1 on some row (needs prompt_mask)
    any_freq_presence: bool        # frequency or presence penalty on some row
    any_top_k: bool                # some random row with 1 <= top_k < V
    any_top_p: bool                # some random row with top_p < 1
    any_min_p: bool                # some random row with min_p > 0
    max_top_k: int                 # largest enabled top_k (V when none)
    generators: list               # [B] torch.Generator | None; None -> the sampler's shared generator
    output_counts: Tensor | None   # [B, V] float32 counts of generated tokens (when any_penalty)
    prompt_mask: Tensor | None     # [B, V] bool: token occurs in the prompt (when any_repetition)
    banned_mask: Tensor | None     # [B, V] bool: tokens banned this step (min_tokens), or None
    max_num_logprobs: int | None   # max over rows of params.logprobs; None if no row wants them
    vocab_size: int
    seeded_rows: tuple[int, ...] = ()      # random rows that own a generator
    any_shared_random: bool = False        # some random row uses the shared generator
    # logit_bias of every row, flat: logits.view(-1)[bias_index] += bias_values (None: no row)
    bias_index: Tensor | None = None       # [nnz] int64, row * V + token
    bias_values: Tensor | None = None      # [nnz] float32
    # structured outputs: bit j of word w of row i allows token 32 w + j (None: no row has a
    # grammar; rows without one are all ones)
    token_bitmask: Tensor | None = None    # [B, ceil(V / 32)] int32

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device,
        *,
        eos_token_ids: Sequence[int] = (),
        token_bitmask: Tensor | None = None,
    ) -> "SamplingBatch":
        """Turn per-request params (+ the tokens seen so far) into batch tensors on ``device``.

        ``min_tokens``: rows that have generated fewer than ``min_tokens`` tokens get their
        ``stop_token_ids`` banned (logit -inf), plus ``eos_token_ids`` (optional, keyword-only)
        unless the row sets ``ignore_eos``. Banning happens before penalties and does not affect
        the returned (raw) logprobs.
        Token ids outside ``[0, vocab_size)`` in the prompt/output are ignored.
        ``token_bitmask`` (structured outputs): an int32 [B, ceil(V / 32)] tensor of the tokens
        each row may take (all ones on rows without a grammar), moved to ``device`` here.
        """
        B = len(params)
        V = int(vocab_size)
        if V < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size!r}")
        for name, seq in (("prompt_token_ids", prompt_token_ids),
                          ("output_token_ids", output_token_ids), ("generators", generators)):
            if len(seq) != B:
                raise ValueError(f"{name} has {len(seq)} rows, expected {B} (one per params)")
        device = torch.device(device)
        if token_bitmask is not None:
            if tuple(token_bitmask.shape) != (B, (V + 31) // 32) \
                    or token_bitmask.dtype != torch.int32:
                raise ValueError(f"token_bitmask must be int32 [{B}, {(V + 31) // 32}], got "
                                 f"{token_bitmask.dtype} {tuple(token_bitmask.shape)}")
            token_bitmask = token_bitmask.to(device, non_blocking=True)

        if all(p.greedy and p.logprobs is None and p.min_tokens == 0 and not p.has_penalty
               and p.logit_bias is None for p in params):
            # Fast path (plain greedy decoding): nothing but an argmax will read the batch.
            return cls(temperature=None, top_k=None, top_p=None, min_p=None, presence=None,
                       frequency=None, repetition=None, greedy_mask=None, all_greedy=True,
                       all_random=False, any_penalty=False, any_repetition=False,
                       any_freq_presence=False, any_top_k=False, any_top_p=False,
                       any_min_p=False, max_top_k=V, generators=list(generators),
                       output_counts=None, prompt_mask=None, banned_mask=None,
                       max_num_logprobs=None, vocab_size=V, token_bitmask=token_bitmask)

        greedy = [p.greedy for p in params]
        temps, top_ks, top_ps, min_ps = [], [], [], []
        for p, g in zip(params, greedy):
            if g:
                temps.append(1.0); top_ks.append(V); top_ps.append(1.0); min_ps.append(0.0)
            else:
                temps.append(p.temperature)
                top_ks.append(V if p.top_k < 0 or p.top_k >= V else p.top_k)
                top_ps.append(p.top_p)
                min_ps.append(p.min_p)
        pres = [p.presence_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        rep = [p.repetition_penalty for p in params]

        # One host->device copy for all the float rows, one for the int rows.
        pin = device.type == "cuda"
        floats = torch.tensor([temps, top_ps, min_ps, pres, freq, rep], dtype=torch.float32,
                              pin_memory=pin).reshape(6, B).to(device, non_blocking=True)
        ints = torch.tensor([top_ks, [int(g) for g in greedy]], dtype=torch.int64,
                            pin_memory=pin).reshape(2, B).to(device, non_blocking=True)
        temperature, top_p, min_p, presence, frequency, repetition = floats.unbind(0)
        top_k, greedy_i = ints.unbind(0)

        rep_rows = [r != 1.0 for r in rep]
        fp_rows = [f != 0.0 or q != 0.0 for f, q in zip(freq, pres)]
        pen_rows = [a or b for a, b in zip(rep_rows, fp_rows)]
        any_repetition, any_freq_presence = any(rep_rows), any(fp_rows)
        any_penalty = any_repetition or any_freq_presence

        output_counts = prompt_mask = banned_mask = None
        if any_penalty:
            # Counts only for rows that use them (other rows stay zero: no host work for them).
            idx = _flat_index([o if on else () for o, on in zip(output_token_ids, pen_rows)], V)
            output_counts = torch.zeros(B * V, dtype=torch.float32, device=device)
            if idx.numel():
                idx = _upload(idx, device)
                output_counts.index_add_(0, idx, torch.ones(idx.shape, dtype=torch.float32,
                                                            device=device))
            output_counts = output_counts.view(B, V)
        if any_repetition:
            prompt_mask = _mask_from_ids(
                [t if on else () for t, on in zip(prompt_token_ids, rep_rows)], B, V, device)

        # min_tokens: ban stop ids (and EOS unless ignore_eos) while the row is too short.
        eos = tuple(int(e) for e in eos_token_ids)
        bans = [(p.stop_token_ids + (() if p.ignore_eos else eos)) if len(out) < p.min_tokens
                else () for p, out in zip(params, output_token_ids)]
        if any(bans):
            banned_mask = _mask_from_ids(bans, B, V, device)

        bias_index = bias_values = None
        biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
        if biased:
            flat = [(i * V + t, b) for i, bias in biased for t, b in bias.items() if 0 <= t < V]
            if flat:
                bias_index = _upload(torch.tensor([f for f, _ in flat], dtype=torch.int64),
                                     device)
                bias_values = _upload(torch.tensor([b for _, b in flat], dtype=torch.float32),
                                      device)

        enabled_ks = [k for k in top_ks if k < V]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        gens = list(generators)
        return cls(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            presence=presence, frequency=frequency, repetition=repetition,
            greedy_mask=greedy_i.bool(),
            all_greedy=all(greedy), all_random=bool(greedy) and not any(greedy),
            any_penalty=any_penalty, any_repetition=any_repetition,
            any_freq_presence=any_freq_presence,
            any_top_k=bool(enabled_ks), any_top_p=any(p < 1.0 for p in top_ps),
            any_min_p=any(m > 0.0 for m in min_ps),
            max_top_k=max(enabled_ks) if enabled_ks else V,
            generators=gens,
            output_counts=output_counts, prompt_mask=prompt_mask, banned_mask=banned_mask,
            max_num_logprobs=max(wanted) if wanted else None,
            vocab_size=V,
            seeded_rows=tuple(i for i, (g, gr) in enumerate(zip(gens, greedy))
                              if g is not None and not gr),
            any_shared_random=any(g is None and not gr for g, gr in zip(gens, greedy)),
            bias_index=bias_index, bias_values=bias_values, token_bitmask=token_bitmask,
        )


def _upload(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on device without waiting for the work queued there: through pinned memory
    on CUDA (a pageable upload waits for the step in flight, whose forward was just queued)."""
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _flat_index(rows: Sequence[Sequence[int]], V: int) -> Tensor:
    """CPU int64 tensor of ``row * V + token`` for every in-range token of every row."""
    lengths = [len(r) for r in rows]
    total = sum(lengths)
    if total == 0:
        return torch.empty(0, dtype=torch.int64)
    toks = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64)
    row_ids = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int64),
                                      torch.tensor(lengths, dtype=torch.int64), output_size=total)
    ok = (toks >= 0) & (toks < V)
    if not bool(ok.all()):           # host tensors: no device sync
        toks, row_ids = toks[ok], row_ids[ok]
    return row_ids * V + toks


def _mask_from_ids(rows: Sequence[Sequence[int]], B: int, V: int, device) -> Tensor:
    mask = torch.zeros(B * V, dtype=torch.bool, device=device)
    idx = _flat_index(rows, V)
    if idx.numel():
        # (index_fill_ passes the value to its kernel; `mask[idx] = True` copies it up as a 0-dim
        # tensor by a blocking copy, which waits for the forward in flight: pytorch/pytorch#186486)
        mask.index_fill_(0, _upload(idx, device), True)
    return mask.view(B, V)


# =================================================================================================
# Logit processing
# =================================================================================================
def apply_token_bitmask(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Tokens a row's bitmask does not allow get -inf (a new tensor), or ``logits`` itself when
    no row has a grammar."""
    mask = batch.token_bitmask
    if mask is None:
        return logits
    B, V = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    allowed = ((mask.unsqueeze(-1) >> shifts) & 1).view(B, -1)[:, :V].bool()
    return logits.masked_fill(~allowed, _NEG_INF)


def apply_logit_bias(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Each row's logit_bias added to its logits (a new tensor), or ``logits`` itself when no
    row has one. (Every (row, token) appears once in the index: index_add_ adds each once.)"""
    if batch.bias_index is None:
        return logits
    out = logits.clone(memory_format=torch.contiguous_format)
    out.view(-1).index_add_(0, batch.bias_index, batch.bias_values)
    return out


def apply_token_bans(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Set banned tokens (min_tokens: EOS / stop ids) to -inf. Returns a new tensor if anything
    is banned, else ``logits`` itself."""
    if batch.banned_mask is None:
        return logits
    return logits.masked_fill(batch.banned_mask, _NEG_INF)


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition penalty (HF rule, prompt ∪ output tokens), then frequency and presence
    penalties (output tokens only). Never modifies ``logits`` in place; returns it unchanged when
    no row has a penalty."""
    if not batch.any_penalty:
        return logits
    counts = batch.output_counts
    out = logits
    if batch.any_repetition:
        seen = batch.prompt_mask | (counts > 0)
        rep = batch.repetition.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        out = torch.where(seen, penalised, logits)
    if batch.any_freq_presence:
        # counts are non-negative integers, so clamp(max=1) == (counts > 0) as float
        pen = counts * batch.frequency.unsqueeze(1)
        pen.addcmul_(counts.clamp(max=1.0), batch.presence.unsqueeze(1))
        out = out - pen
    return out


def _apply_min_p(x: Tensor, min_p: Tensor) -> Tensor:
    """In place: drop tokens with prob < min_p * max_prob, i.e. x < x_max + log(min_p)."""
    thresh = x.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)  # log(0) = -inf: no-op
    return x.masked_fill_(x < thresh, _NEG_INF)


def _apply_top_k_only(x: Tensor, top_k: Tensor, max_top_k: int) -> Tensor:
    """In place: keep tokens >= the k-th largest value (ties at the boundary are kept, as in HF /
    vLLM). Uses a partial top-k of the largest enabled k instead of a full sort."""
    V = x.shape[-1]
    vals = x.topk(max_top_k, dim=-1).values                        # [B, kmax], descending
    kth = vals.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    kth = kth.masked_fill((top_k >= V).unsqueeze(1), _NEG_INF)     # disabled rows: keep all
    return x.masked_fill_(x < kth, _NEG_INF)


def _apply_top_k_top_p(x: Tensor, top_k: Tensor | None, top_p: Tensor) -> Tensor:
    """Top-k (optional) then top-p on the renormalised distribution, via one descending sort.

    Top-p keeps the smallest prefix (by descending prob) whose cumulative prob is >= top_p: a token
    is kept iff the mass strictly before it is < top_p, so the top token is always kept."""
    sorted_x, idx = x.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_x.gather(1, (top_k - 1).unsqueeze(1))          # top_k == V: the minimum
        sorted_x.masked_fill_(sorted_x < kth, _NEG_INF)
    probs = sorted_x.softmax(dim=-1)
    before = probs.cumsum(dim=-1).sub_(probs)                       # exclusive cumulative sum
    p = top_p.unsqueeze(1)
    drop = (before >= p) & (p < 1.0)    # rows with top_p == 1 are untouched despite rounding
    sorted_x.masked_fill_(drop, _NEG_INF)
    return x.scatter_(1, idx, sorted_x)


# =================================================================================================
# Sampler
# =================================================================================================
class SamplerOutput(NamedTuple):
    token_ids: Tensor                 # [B] int64
    logprobs: Tensor | None           # [B] float32, raw logprob of the sampled token (None
                                      # when no row asked for logprobs)
    topk_ids: Tensor | None           # [B, K] int64, K = min(max_num_logprobs, V); None if None
    topk_logprobs: Tensor | None      # [B, K] float32, descending


class Sampler:
    """Stateless apart from ``generator``, the shared generator for rows without their own (None:
    torch's default generator of the logits' device). Per-row generators must live on the same
    device as the logits."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[1] != batch.vocab_size \
                or logits.shape[0] != batch.batch_size:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match the batch "
                             f"({batch.batch_size}, {batch.vocab_size})")
        logits = logits.float()                                 # may alias: no in-place on it
        # Raw logprobs cost a pass over [B, V]: only when some row asked for them.
        want_logprobs = batch.max_num_logprobs is not None
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        x = apply_penalties(apply_token_bans(apply_logit_bias(
            apply_token_bitmask(logits, batch), batch), batch), batch)

        greedy_ids = None if batch.all_random else x.argmax(dim=-1)
        if batch.all_greedy:
            token_ids = greedy_ids
        else:
            sampled = self._sample(x, batch)
            token_ids = sampled if batch.all_random else torch.where(
                batch.greedy_mask, greedy_ids, sampled)

        token_logprobs = topk_ids = topk_logprobs = None
        if want_logprobs:
            token_logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
            k = min(batch.max_num_logprobs, batch.vocab_size)
            topk_logprobs, topk_ids = raw_logprobs.topk(k, dim=-1)
        return SamplerOutput(token_ids, token_logprobs, topk_ids, topk_logprobs)

    # ---------------------------------------------------------------------------------------------
    def _sample(self, x: Tensor, batch: SamplingBatch) -> Tensor:
        x = x / batch.temperature.unsqueeze(1)                  # new tensor: in-place from here on
        if batch.any_min_p:
            _apply_min_p(x, batch.min_p)
        if batch.any_top_p:
            _apply_top_k_top_p(x, batch.top_k if batch.any_top_k else None, batch.top_p)
        elif batch.any_top_k:
            _apply_top_k_only(x, batch.top_k, batch.max_top_k)
        probs = torch.softmax(x, dim=-1)
        q = self._exponential_noise(probs, batch)
        return probs.div_(q).argmax(dim=-1)

    def _exponential_noise(self, like: Tensor, batch: SamplingBatch) -> Tensor:
        """Exp(1) noise [B, V]. Seeded random rows draw exactly V numbers from their own generator
        (independent of batch composition); other random rows share ``self.generator``. Rows of
        greedy requests may hold garbage: their sampled token is discarded."""
        q = torch.empty_like(like)
        if batch.any_shared_random:
            q.exponential_(generator=self.generator)
        gens = batch.generators
        for i in batch.seeded_rows:
            q[i].exponential_(generator=gens[i])
        # Exp(1) can round to exactly 0; keep probs / q finite (0 / 0 would be NaN, and argmax
        # picks NaN). 1 / tiny is still finite in float32.
        return q.clamp_min_(_TINY)
