"""CUDAGraphRunner: whole forwards captured once per shape bucket and replayed, for decode-only
steps and for steps that carry prefill tokens (mixed or lone prefill).

Full graphs, not piecewise: the Triton attention path reads nothing from the host (its launcher
uses shapes and two static upper bounds, max_query_len and max_seq_len, which choose launches and
split counts, never correctness), and it handles a padded mixed batch (StepInputs: padding
sequences with q_len 0, padding tokens in the scratch block). So one graph covers embedding,
every layer and the final norm; logits and sampling run after the replay on the rows that matter.

Two graph families share one memory pool and one set of input buffers (StepInputs):

    decode  key (tier, bs):  bs sequences of one token each (bs in DECODE_SIZES up to
                             cuda_graph_max_batch); max_query_len 1 (the decode launch only)
    mixed   key (tier, T):   T tokens (T in mixed_sizes up to the token budget) in up to
                             min(T, max_seqs) sequences of any lengths; max_query_len T

The tier is the captured max_seq_len: a batch of short sequences replays a graph captured for a
short bound (no split-K, no reduce pass) instead of one sized for max_model_len (decode: 511
and max_model_len; mixed: 511, 2047, 8191, ... and max_model_len). A step picks
the smallest bucket that holds it (plan); beyond the largest, or with enforce_eager, it runs
eagerly over the same buffers.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from ..attention.metadata import AttentionMetadata, forward_context
from ..step_shapes import graph_bucket, mixed_sizes
from .step_inputs import StepInputs


SHORT_CONTEXT = 511  # below 512 keys the attention kernel runs without split-K
# Mixed steps' context tiers grow x4: their prefill launch sizes its split-K from the bound, and
# a bound far above the batch's real contexts splits short key ranges into many pieces plus a
# reduce pass (measured: 32 decodes at 1k context + a 256-token chunk spent 1.3 ms in attention
# under a 32k bound). Decode graphs keep two tiers: their split count barely moves with it.
MIXED_TIER_RATIO = 4


def context_tiers(max_seq_len: int, ratio: int) -> list[int]:
    """Captured max_seq_len bounds: SHORT_CONTEXT, then x ratio apart (ratio 1: none between)
    while at most half of max_seq_len, then max_seq_len itself."""
    tiers, t = set(), SHORT_CONTEXT
    while ratio > 1 and 2 * t < max_seq_len:
        tiers.add(t)
        t = (t + 1) * ratio - 1
    return sorted(tiers | {min(SHORT_CONTEXT, max_seq_len), max_seq_len})


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 513, 8))
    return [s for s in sizes if s <= max_batch] or [1]


@dataclass(frozen=True)
class GraphPlan:
    key: tuple[str, int, int]   # (family, tier, size)
    num_tokens: int             # padded shape the step is staged to
    num_seqs: int


class CUDAGraphRunner:
    def __init__(self, model, inputs: StepInputs, max_batch: int, max_mixed_tokens: int,
                 max_seq_len: int):
        """max_batch: largest decode batch graphed (0: none); max_mixed_tokens: largest mixed
        step graphed (0: none); max_seq_len: the longest sequence served."""
        self.model = model
        self.inputs = inputs
        self.decode_sizes = capture_sizes(max_batch) if max_batch > 0 else []
        self.mixed_sizes = mixed_sizes(min(max_mixed_tokens, inputs.max_tokens))
        self.tiers = context_tiers(max_seq_len, 1)
        self.mixed_tiers = context_tiers(max_seq_len, MIXED_TIER_RATIO)
        self.graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int, int], torch.Tensor] = {}
        self.pool = None
        self.capture_s = 0.0
        self.memory_bytes = 0

    @staticmethod
    def _tier(tiers: list[int], max_seq_len: int) -> int | None:
        return next((t for t in tiers if t >= max_seq_len), None)

    def plan(self, num_tokens: int, num_seqs: int, max_query_len: int,
             max_seq_len: int) -> GraphPlan | None:
        """The graph this step replays (the smallest that holds it), or None: run eagerly."""
        if max_query_len == 1:
            tier = self._tier(self.tiers, max_seq_len)
            bs = next((s for s in self.decode_sizes if s >= num_seqs), None)
            if bs is not None and tier is not None:
                return GraphPlan(("decode", tier, bs), bs, bs)
        tier = self._tier(self.mixed_tiers, max_seq_len)
        t = graph_bucket(num_tokens, self.mixed_sizes)
        if t is None or tier is None:
            return None
        b = self._mixed_seqs(t)
        return GraphPlan(("mixed", tier, t), t, b) if num_seqs <= b else None

    def _mixed_seqs(self, num_tokens: int) -> int:
        return min(num_tokens, self.inputs.max_seqs)

    def _meta(self, family: str, tier: int, size: int) -> AttentionMetadata:
        x = self.inputs
        b = size if family == "decode" else self._mixed_seqs(size)
        return AttentionMetadata(slot_mapping=x.slot_mapping[:size],
                                 query_start_loc=x.query_start_loc[:b + 1],
                                 seq_lens=x.seq_lens[:b], block_tables=x.block_tables[:b],
                                 max_query_len=1 if family == "decode" else size,
                                 max_seq_len=tier, num_decodes=b if family == "decode" else 0)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every graph, largest first (later graphs reuse the pool's blocks); records
        capture_s and memory_bytes (device memory the graphs added).

        The garbage collector is run first and kept off while capturing: an unreachable engine
        (a reference cycle) collected mid-capture destroys its CUDA graphs, which a capture in
        progress forbids, and the capture fails (torch.cuda.graph collects only when
        torch.compiler.config.force_cudagraph_gc is set)."""
        t0 = time.perf_counter()
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_all()
        finally:
            if was_enabled:
                gc.enable()
        self.capture_s = time.perf_counter() - t0

    def _capture_all(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved0 = torch.cuda.memory_reserved()
        keys = [("mixed", tier, t) for tier in reversed(self.mixed_tiers)
                for t in reversed(self.mixed_sizes)]
        keys += [("decode", tier, s) for tier in reversed(self.tiers)
                 for s in reversed(self.decode_sizes)]
        x = self.inputs
        for key in keys:
            family, tier, size = key
            meta = self._meta(family, tier, size)
            x.stage([], size, meta.seq_lens.shape[0])   # all padding: reads and writes nothing live
            with forward_context(meta):
                self.model(x.input_ids[:size], x.positions[:size])  # warm-up (lazy init, compiles)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                with forward_context(meta):
                    self.outputs[key] = self.model(x.input_ids[:size], x.positions[:size])
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[key] = g
        torch.cuda.synchronize()
        torch.cuda.empty_cache()   # the warm-ups' activations: the graphs keep their own pool
        self.memory_bytes = torch.cuda.memory_reserved() - reserved0   # the graphs' pool

    def replay(self, plan: GraphPlan, num_tokens: int) -> torch.Tensor:
        """Replays the planned graph over the staged inputs; hidden states of the first
        num_tokens rows (graph memory: valid until the next replay)."""
        self.graphs[plan.key].replay()
        return self.outputs[plan.key][:num_tokens]

    def release(self) -> None:
        """Drop the graphs before the process group or the cache they reference goes away."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
