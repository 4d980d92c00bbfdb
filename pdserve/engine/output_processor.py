"""OutputProcessor: from sampled tokens to what a caller sees. It owns, per user request, the
group of its n sequences and, per sequence, its incremental detokenizer, its stop conditions
(EOS, stop token ids, stop strings, max_tokens, max_model_len), its logprob entries, and what
was already reported; it builds the RequestOutputs.

    add(group)                         a new request's sequences (created by the engine core)
    scheduled(seq_ids, now)            the scheduler handed these to the runner (queue time ends)
    append(seq, token, now) -> stop    record a token; says whether the sequence must stop
    finish(seq, stop, held)            the scheduler removed it: set its finish reason
    take_outputs(now)                  the RequestOutputs of the groups touched since the last call

A report is cumulative (the offline LLM, AsyncLLM in process) or, with deltas=True, what the
worker -> client channel carries (worker.py; the client's DeltaDecoder, worker/output_delta.py,
rebuilds the cumulative one from them). Both are one rule: a cumulative report is a delta from
nothing.

    first report:  prompt ids, every token / logprob / prompt logprob so far, the text so far
    later reports: prompt ids [], the tokens / logprobs / prompt logprobs not reported before,
                   text "" (new_text holds what is new)
    a sequence's finished report: as later, but its whole final text (stop strings cut),
                   which the client takes as it is

Sequences are found through one table (sequence id -> (group, index)): an id is never parsed.
It never touches the scheduler: the engine core applies the stops it returns (under async
scheduling, one step after the tokens were sampled). Pure Python: the tokenizer is any object
with decode(ids, skip_special).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..protocol import KVSource
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .executor import SampledToken
from .request import Request, RequestStatus


class Stop(NamedTuple):
    status: RequestStatus
    reason: int | str | None        # the stop token id or stop string that matched (else None)


@dataclass(eq=False)
class _Seq:
    req: Request
    out: CompletionOutput
    detok: IncrementalDetokenizer | None
    reported_tokens: int = 0
    reported_logprobs: int = 0


@dataclass(eq=False)
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Seq]
    final_only: bool = False          # report only when finished (offline batches)
    metrics: dict[str, float] = field(default_factory=dict)
    num_unfinished: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    kv_transfer: KVSource | None = None
    reported: bool = False              # a report was made (deltas: the next is not the first)
    reported_prompt_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int,
                 deltas: bool = False):
        self.tokenizer = tokenizer
        self.deltas = deltas            # reports as deltas (the module docstring)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.groups: dict[str, _Group] = {}
        self._table: dict[str, tuple[_Group, int]] = {}   # sequence id -> (group, index)
        self._touched: dict[str, _Group] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, seqs: list[Request], final_only: bool, arrival: float,
            done_ids: list[int]) -> None:
        """A request's sequences, index i = seqs[i]; done_ids: output tokens reported before
        (P/D: the producer's), already in every sequence's output and not reported again."""
        entries = []
        for i, req in enumerate(seqs):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                               params.skip_special_tokens, tuple(params.stop or ()))
                for t in done_ids:
                    detok.add(t)
                detok.take_new_text(False)
            # token_ids is the sequence's own output list: the scheduler appends, nobody copies.
            entries.append(_Seq(req, CompletionOutput(
                i, "", req.output_token_ids, [] if params.logprobs is not None else None),
                detok, reported_tokens=len(done_ids)))
        group = _Group(request_id, prompt, prompt_token_ids, params, entries, final_only,
                       {"arrival": arrival}, num_unfinished=len(entries),
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self.groups[request_id] = group
        for i, s in enumerate(entries):
            self._table[s.req.request_id] = (group, i)

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._table

    def request_id_of(self, seq_id: str) -> str:
        return self._table[seq_id][0].request_id

    def remove(self, request_id: str) -> list[Request]:
        """Forget a request (aborted); returns its sequences for the scheduler to drop."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return []
        self._touched.pop(request_id, None)
        for s in group.seqs:
            self._table.pop(s.req.request_id, None)
        return [s.req for s in group.seqs]

    def scheduled(self, seq_ids, now: float) -> None:
        """The scheduler handed these sequences to the runner (SchedulerOutput.new_requests):
        a request's first such time is its "scheduled" metric, where its queue time ends (a
        preempted sequence handed over again, or a sibling, keeps the first)."""
        for sid in seq_ids:
            entry = self._table.get(sid)
            if entry is not None:
                entry[0].metrics.setdefault("scheduled", now)

    def add_prompt_logprobs(self, seq_id: str, entries: list[SampledToken]) -> None:
        group = self._table[seq_id][0]
        group.prompt_logprobs.extend(self.logprob_entry(tok) for tok in entries)

    def append(self, req: Request, tok: SampledToken, now: float) -> Stop | None:
        """`tok` was sampled for `req` (the scheduler already appended it to its output):
        record it; returns why the sequence stops, or None."""
        group, i = self._table[req.request_id]
        seq, p = group.seqs[i], group.params
        if "first_token" not in group.metrics:
            group.metrics["first_token"] = now
        if not group.final_only:
            self._touched[group.request_id] = group
        out = seq.out
        if out.logprobs is not None:
            out.logprobs.append(self.logprob_entry(tok))
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            # The token that stops the sequence is not text (as in vLLM): with
            # skip_special_tokens=False the EOS would otherwise end the text as "<|im_end|>".
            if not p.ignore_eos and tok.token_id in self.eos_token_ids:
                return Stop(RequestStatus.FINISHED_STOPPED, None)
            if tok.token_id in p.stop_token_ids:
                return Stop(RequestStatus.FINISHED_STOPPED, tok.token_id)
        stop_str = seq.detok.add(tok.token_id) if seq.detok is not None else None
        if n_out >= p.min_tokens:
            if stop_str is not None:
                return Stop(RequestStatus.FINISHED_STOPPED, stop_str)
        if n_out >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return Stop(RequestStatus.FINISHED_LENGTH, None)
        return None

    def finish(self, req: Request, stop: Stop, held: list[int] | None) -> None:
        """The scheduler removed `req` for `stop`; held: its blocks, kept for a P/D consumer."""
        group, i = self._table[req.request_id]
        out = group.seqs[i].out
        out.finish_reason, out.stop_reason = stop.status.value, stop.reason
        if held is not None:  # P/D producer: where a consumer finds this prompt's KV
            group.kv_transfer = KVSource("", group.request_id, held, req.num_computed_tokens,
                                         list(req.output_token_ids))
        group.num_unfinished -= 1
        if group.finished:
            self._touched[group.request_id] = group

    def take_outputs(self, now: float) -> list[RequestOutput]:
        touched, self._touched = self._touched, {}
        return [self._make_output(g, now) for g in touched.values()]

    def logprob_entry(self, tok: SampledToken) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        for rank, (tid, lp) in enumerate(tok.top or (), start=1):
            entry[tid] = Logprob(lp, rank, self._token_text(tid))
        if tok.token_id not in entry:
            # rank of the sampled token among all tokens: unknown beyond the top-k; report k + 1
            entry[tok.token_id] = Logprob(tok.logprob, len(entry) + 1, self._token_text(tok.token_id))
        return entry

    def _token_text(self, tid: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([tid], False)

    def _make_output(self, group: _Group, now: float) -> RequestOutput:
        """The group's report (the module docstring). Its lists are new, the caller's to keep (a
        later delta's token_ids is its new_token_ids)."""
        finished = group.finished
        if finished:
            group.metrics["finished"] = now
            self.remove(group.request_id)
        whole = not (self.deltas and group.reported)
        group.reported = True
        outs = []
        for s in group.seqs:
            o = s.out
            new_ids = o.token_ids[s.reported_tokens:]
            s.reported_tokens = len(o.token_ids)
            new_text = ""
            if s.detok is not None:
                new_text = s.detok.take_new_text(o.finished)
                o.text = s.detok.text if o.finished else s.detok.text[: s.detok.reported]
            lps = o.logprobs
            if lps is not None:
                lps, s.reported_logprobs = lps[0 if whole else s.reported_logprobs:], len(lps)
            outs.append(CompletionOutput(o.index, o.text if whole or o.finished else "",
                                         o.token_ids[:] if whole else new_ids, lps,
                                         o.finish_reason, o.stop_reason, new_ids, new_text))
        plp = group.prompt_logprobs
        if plp is not None:
            plp, group.reported_prompt_logprobs = (
                plp[0 if whole else group.reported_prompt_logprobs:], len(plp))
        return RequestOutput(group.request_id, group.prompt,
                             group.prompt_token_ids if whole else [], outs, finished,
                             dict(group.metrics), plp, group.kv_transfer,
                             group.seqs[0].req.num_cached_tokens or 0)
