"""ModelRunner: turns a SchedulerOutput into tensors, runs one forward over the mixed batch,
samples, and returns the new token of every sequence that reached its end this step.

It owns the KV cache tensor and each sequence's sampling state (params, generator, the tokens the
penalties need); the scheduler owns which blocks hold what.

KV cache layout: one tensor [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim];
layer i works on the view kv_cache[i]. A block id means the same slots in every layer, so moving a
request's KV (P/D disaggregation) is moving its block ids' slices layer by layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..attention.metadata import AttentionMetadata, forward_context
from ..engine.scheduler import SchedulerOutput
from ..layers.sampler import Sampler, SamplingBatch


class SampledToken(NamedTuple):
    token_id: int
    logprob: float | None                      # of the sampled token (when logprobs were asked)
    top: list[tuple[int, float]] | None        # top-k (id, logprob), most likely first


@dataclass
class _SeqState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: object
    generator: torch.Generator | None
    extra: dict = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, seed: int, eos_token_ids: tuple[int, ...] = ()):
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = eos_token_ids
        attn = model.layers[0].self_attn
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, attn.num_kv_heads,
                                    attn.head_dim, dtype=kv_dtype, device=device)
        model.bind_kv_cache(self.kv_cache)
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.seqs: dict[str, _SeqState] = {}

    def _add(self, data) -> None:
        gen = None
        if data.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(data.seed)
        self.seqs[data.request_id] = _SeqState(list(data.prompt_token_ids),
                                               list(data.output_token_ids), data.params, gen)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        for rid in out.finished_ids:
            self.seqs.pop(rid, None)
        for data in out.new_requests:
            self._add(data)
        if out.is_empty:
            return {}
        for src, dst in out.block_copies:
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

        # Decode rows (one token) first: the attention backend batches them.
        chunks = sorted(out.chunks, key=lambda c: len(c.token_ids) != 1)
        meta, input_ids, positions = self._prepare(chunks)
        with forward_context(meta):
            hidden = self.model(input_ids, positions)

        rows: dict[str, int] = {}
        for i, c in enumerate(chunks):
            if c.sample:
                rows[c.request_id] = meta.query_start_loc[i + 1] - 1
        for f in out.forks:
            rows[f.request_id] = rows[f.parent_id]
        if not rows:
            return {}
        ids = list(rows)
        logits = self.model.compute_logits(
            hidden[torch.tensor(list(rows.values()), device=self.device)])
        seqs = [self.seqs[r] for r in ids]
        batch = SamplingBatch.build(
            [s.params for s in seqs], [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs], [s.generator for s in seqs],
            self.vocab_size, self.device, eos_token_ids=self.eos_token_ids)
        res = self.sampler(logits, batch)
        tokens = res.token_ids.tolist()
        want = [s.params.logprobs for s in seqs]
        lp = res.logprobs.tolist() if any(w is not None for w in want) else None
        top_ids = res.topk_ids.tolist() if res.topk_ids is not None else None
        top_lp = res.topk_logprobs.tolist() if res.topk_logprobs is not None else None
        result = {}
        for j, (rid, s) in enumerate(zip(ids, seqs)):
            s.output_token_ids.append(tokens[j])
            k = want[j]
            top = None
            if k and top_ids is not None:
                top = list(zip(top_ids[j][:k], top_lp[j][:k]))
            result[rid] = SampledToken(tokens[j], lp[j] if k is not None else None, top)
        return result

    def _prepare(self, chunks):
        bs = self.block_size
        qsl = [0]
        seq_lens, toks, pos = [], [], []
        for c in chunks:
            n = len(c.token_ids)
            toks.extend(c.token_ids)
            pos.extend(range(c.start_pos, c.start_pos + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(c.start_pos + n)
        max_blocks = max(len(c.block_table) for c in chunks)
        tables = torch.tensor([c.block_table + [0] * (max_blocks - len(c.block_table))
                               for c in chunks], dtype=torch.long)
        positions = torch.tensor(pos, dtype=torch.long)
        row = torch.repeat_interleave(torch.arange(len(chunks)),
                                      torch.tensor([len(c.token_ids) for c in chunks]))
        slots = tables[row, positions // bs] * bs + positions % bs
        num_decodes = sum(1 for c in chunks if len(c.token_ids) == 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev), query_start_loc=qsl, seq_lens=seq_lens,
            block_tables=tables.to(dev), num_decodes=num_decodes,
            decode_seq_lens=torch.tensor(seq_lens[:num_decodes], dtype=torch.long, device=dev))
        return meta, torch.tensor(toks, dtype=torch.long, device=dev), positions.to(dev)
