"""ModelRunner: turns a SchedulerOutput into tensors, runs one forward over the mixed batch,
samples, and returns the new token of every sequence that reached its end this step (the
engine core's Executor, engine/executor.py).

It owns the KV cache tensor and each sequence's sampling state (params, generator, the tokens the
penalties need); the scheduler owns which blocks hold what.

KV cache layout: one tensor [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim];
layer i works on the view kv_cache[i]. A block id means the same slots in every layer, so moving a
request's KV (P/D disaggregation) is moving its block ids' slices layer by layer.

Async scheduling (execute_async): the sampled tokens stay on the device, with the row of each
sequence, and the next step's pending inputs (ScheduledChunk.last_pending) are written from them
into its input_ids on the device before its forward (_write_pending); the host gets its copy
through a non-blocking copy that StepResult.result() waits for. Under TP the driver broadcasts
the tokens to the other ranks after sampling, so every rank fills the same inputs.

    step N   sample -> tokens [rows] (device) ----------------------> copy to host -> result()
                                 | rows: {seq id: row}
    step N+1 input_ids (staged from the host, 0 at pending slots) <- tokens[row] at each slot

KV cache layout: one tensor [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim];
layer i works on the view kv_cache[i]. A block id means the same slots in every layer, so moving a
request's KV (P/D disaggregation) is moving its block ids' slices layer by layer.
"""
from __future__ import annotations

import functools
import logging
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..attention.metadata import AttentionMetadata, forward_context
from ..devices import on_device
from ..engine.executor import Ready, SampledToken, StepHandle
from ..engine.kv_coordinator import KVStepWork
from ..engine.scheduler import ScheduledChunk, SchedulerOutput
from ..layers.parallel_state import get_tp_group
from ..layers.sampler import Sampler, SamplingBatch
from ..protocol import KVDrop
from .cuda_graph import CUDAGraphRunner
from .kv_host_tier import KVHostTier
from .step_inputs import StepInputs

logger = logging.getLogger(__name__)


@dataclass
class _SeqState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: object
    generator: torch.Generator | None
    prompt_logprobs_done: int = 0   # prompt positions whose next-token logprob was computed
    matcher: object = None          # structured outputs: its grammar's state (structured/)


# Prompt logprobs: rows of logits made at once (a long prompt's [rows, vocab] float32 adds up).
_PROMPT_LOGPROB_ROWS = 512


class _PendingInputs(NamedTuple):
    """Where a step's inputs take the tokens the step before sampled (device tensors)."""
    slots: torch.Tensor      # [k] int64: positions in the step's flat input_ids
    rows: torch.Tensor       # [k] int64: rows of `tokens`
    tokens: torch.Tensor     # [rows] int64: the previous step's sampled tokens


class StepResult:
    """execute_async's handle: the step's sampled tokens (and logprobs) on their way to the host
    (copies behind an event on CUDA; on CPU they are there already)."""

    def __init__(self, ids: list[str], seqs: list[_SeqState], want: list[int | None],
                 host: tuple, event: "torch.cuda.Event | None"):
        self._ids, self._seqs, self._want, self._host, self._event = ids, seqs, want, host, event
        self._result: dict[str, SampledToken] | None = None

    def result(self) -> dict[str, SampledToken]:
        if self._result is not None:
            return self._result
        if self._event is not None:
            self._event.synchronize()
        tokens, lp, top_ids, top_lp = (None if t is None else t.tolist() for t in self._host)
        result = {}
        for j, (rid, s) in enumerate(zip(self._ids, self._seqs)):
            # (the state object itself: a finished sequence's id may be in use again)
            s.output_token_ids.append(tokens[j])
            if s.matcher is not None and not s.matcher.done:
                s.matcher.accept(tokens[j])
            k = self._want[j]
            top = None
            if k and top_ids is not None:
                top = list(zip(top_ids[j][:k], top_lp[j][:k]))
            result[rid] = SampledToken(tokens[j], lp[j] if k is not None else None, top)
        self._result = result
        return result


# Prompt logprobs: rows of logits made at once (a long prompt's [rows, vocab] float32 adds up).
_PROMPT_LOGPROB_ROWS = 512


def _own_device(fn):
    """Run a ModelRunner method with its GPU current (pdserve.devices.on_device)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with on_device(self.device):
            return fn(self, *args, **kwargs)
    return wrapper


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, seed: int, eos_token_ids: tuple[int, ...] = (),
                 max_model_len: int = 4096, cuda_graph_max_batch: int = 0,
                 is_driver: bool = True, kv_connector: str | None = None,
                 kv_path: str | None = None, kv_sync: bool = True,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                 cuda_graph_max_tokens: int = 0, share_sampled: bool = False,
                 num_host_blocks: int = 0):
        """is_driver: rank 0 (samples; it also times each forward on the device, see
        take_gpu_times). max_num_batched_tokens / max_num_seqs: the scheduler's per-step bounds
        (they size the step buffers). cuda_graph_max_batch / cuda_graph_max_tokens: the largest
        decode batch / the largest step with prefill tokens replayed as a CUDA graph (0: none;
        both 0: every step runs eagerly). share_sampled: TP with async scheduling: the driver
        broadcasts each step's sampled tokens to every rank (pending inputs are filled on every
        rank). num_host_blocks: the KV cache's host tier on this rank (0: none; kv_host_tier.py),
        which runs each step's SchedulerOutput.kv_moves."""
        cfg = model.config
        # Under TP every rank runs the forward and the logits gather; only the driver (rank 0)
        # samples, and the others learn the tokens from its next SchedulerOutput (or from its
        # broadcast: share_sampled).
        self.is_driver = is_driver
        self.share_sampled = share_sampled
        # the last step's sampled tokens on the device and each sequence's row in them
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self.model = model
        self.device = device
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = eos_token_ids
        attn = model.layers[0].self_attn
        # One block beyond the pool: the scratch block. Padding rows (CUDA-graph buckets) write
        # and read only there, so no slot id ever needs a "none" sentinel.
        self.scratch_block = num_blocks
        shape = (cfg.num_layers, 2, num_blocks + 1, block_size, attn.num_kv_heads, attn.head_dim)
        self.connector = None
        self.kv_sync = kv_sync
        if kv_connector is None:
            self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
        else:  # P/D: a pool other workers can pull from, and the means to pull from theirs
            from ..disagg.connectors import get_connector_class
            cls = get_connector_class(kv_connector)
            self.kv_cache = cls.allocate(shape, kv_dtype, device, kv_path)
            tp = get_tp_group()
            self.connector = cls(self.kv_cache, tp.rank, tp.size, cfg.num_kv_heads)
        model.bind_kv_cache(self.kv_cache)
        # Copy-on-write copies (a shared partial block, a fork): every layer's blocks in one
        # launch of the P/D pull kernel, the pool on both sides. Indexing the pool instead
        # (kv_cache[:, :, dst] = kv_cache[:, :, src]) cost 32 launches on an H100: the view spans
        # more than 2**31 elements, so torch cuts the copy into pieces it can index in 32 bits.
        self._copier = None
        if self.device.type == "cuda" and self.kv_cache.is_contiguous():
            from ..kernels.kv_pull import KVPull
            self._copier = KVPull(self.kv_cache, self.kv_cache)
        self.kv_block_bytes = self.kv_cache[:, :, 0].numel() * self.kv_cache.element_size()
        self.host_tier = KVHostTier(self.kv_cache, num_host_blocks) if num_host_blocks else None
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        # structured outputs (the driver's; set by the engine that has the tokenizer): makes
        # each constrained sequence's matcher and the batch's token bitmask
        self.grammar = None
        self._last_result: StepResult | None = None   # the last step that sampled
        self.seqs: dict[str, _SeqState] = {}
        self._prompt_logprobs: dict[str, list[SampledToken]] = {}
        # Forward timing (driver only): a CUDA event pair per forward, read once complete.
        self._gpu_pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = deque()
        self._gpu_settled: dict[int, float | None] = {}
        # Every forward's inputs (eager and graphed); the warm-up's batches need ~70 tokens.
        self.inputs = StepInputs(max(max_num_batched_tokens, cuda_graph_max_batch, 128),
                                 max(max_num_seqs, cuda_graph_max_batch, 2),
                                 -(-max_model_len // block_size), self.scratch_block, block_size,
                                 device)
        self.graphs = None
        if device.type == "cuda":
            self.warm_up(max_model_len)
        if cuda_graph_max_batch > 0 or cuda_graph_max_tokens > 0:
            self.graphs = CUDAGraphRunner(model, self.inputs, cuda_graph_max_batch,
                                          cuda_graph_max_tokens, max_model_len)
            self.graphs.capture()
            g = self.graphs
            logger.info("CUDA graphs: %d decode (batch <= %d) x %d and %d mixed (tokens <= %d) "
                        "x %d context tiers, captured in %.1f s, %.0f MiB",
                        len(g.decode_sizes), cuda_graph_max_batch, len(g.tiers),
                        len(g.mixed_sizes),
                        cuda_graph_max_tokens, len(g.mixed_tiers), g.capture_s,
                        g.memory_bytes / 2**20)

    @_own_device
    @torch.inference_mode()
    def warm_up(self, max_model_len: int) -> None:
        """Compile, before any request, the kernel variants that the batch mix selects at run
        time. Paged attention chooses split-K for its decode and for its prefill launch from the
        context length and the grid size, a Triton variant each (~1 s to compile): the first
        step that needed one stalled every request in flight (1.3 s TTFT spikes under load).
        Two eager forwards that read and write only the scratch block cover both choices of
        each launch (the choice follows the batch's longest sequence): [short decode row + short
        prefill] and [decode row + prefill chunk, both ending at the longest context served].
        The prefill launch's tiles also follow the step's longest chunk (prefill_config_for in
        kernels/paged_attention.py: wide key tiles up to 128 tokens and from 1,024 on, the
        default between), so both forwards run with a chunk of each kind that the step budget
        and max_model_len allow (one of 129-256 tokens stands for the default)."""
        longest = min(max_model_len, 4096)   # splits begin at 512 (decode) / 2048 (prefill) keys
        bs = self.block_size
        qs = [max(2, min(64, longest // 2))]
        wider = min(256, self.inputs.max_tokens - 1, longest - 1)
        if wider > 128:
            qs.append(wider)

        def chunk(n_tokens: int, start: int) -> ScheduledChunk:
            blocks = -(-(start + n_tokens) // bs)
            return ScheduledChunk("warm-up", [0] * n_tokens, start, [self.scratch_block] * blocks,
                                  False)

        for q in qs:
            for batch in ([chunk(1, 3), chunk(q, 0)],
                          [chunk(1, longest - 1), chunk(q, longest - q)]):
                self._forward(batch)
        self._copy_blocks([(self.scratch_block, self.scratch_block)])   # (the copy-on-write kernel)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """kv_cache[:, :, dst] = kv_cache[:, :, src] for each (src, dst) pair (BlockCopy), on the
        current stream (no dst is another pair's src: copies go to fresh blocks)."""
        if self._copier is None:
            for src, dst in pairs:
                self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
            return
        n = len(pairs)
        pad = [0] * (n % 2)    # (rows of even length: both 16-byte aligned, one compiled variant)
        ids = _to_device([s for s, _ in pairs] + pad + [d for _, d in pairs] + pad, self.device)
        ids = ids.view(2, n + len(pad))
        self._copier(ids[0, :n], ids[1, :n])

    @_own_device
    def release(self) -> None:
        """Free the CUDA graphs (before the cache or a process group they captured goes away)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.connector is not None:
            self.connector.close()
        if self.host_tier is not None:
            self.host_tier.synchronize()

    def _kv_work(self, work: KVStepWork) -> None:
        """P/D: reach new peers (or drop dead ones), apply the driver's verdicts (before this
        forward reads or reuses those blocks), send (producer), start new pulls (consumer)."""
        if self.connector is None:
            raise ValueError("KV transfer needs a kv_connector")
        for peer in work.peers:   # joins and drops, in the order they were announced
            if isinstance(peer, KVDrop):
                self.connector.drop_peer(peer.worker)
            else:
                self.connector.add_peer(peer)
        for rid, ok in work.verdicts:
            self.connector.finish(rid, ok)
        for send in work.sends:
            self.connector.send_blocks(send)
        for load in work.loads:
            self.connector.start_load(load, self.kv_sync)

    @_own_device
    def poll_loads(self):
        """Pulls this rank saw end since the last call (the driver decides for all ranks)."""
        return [] if self.connector is None else self.connector.poll()

    def _add(self, data) -> None:
        gen = None
        if data.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(data.seed)
            if data.output_token_ids and not data.params.greedy:
                # A continuation (P/D: the producer sampled these tokens): each seeded sample
                # drew one [vocab] Exp(1) vector from this generator (Sampler), so draw as many
                # to stand where the producer's left off — the same tokens as on one engine.
                noise = torch.empty(self.vocab_size, dtype=torch.float32, device=self.device)
                for _ in data.output_token_ids:
                    noise.exponential_(generator=gen)
        matcher = None
        spec = getattr(data.params, "structured_outputs", None)
        if spec is not None and self.is_driver:
            if self.grammar is None:
                raise RuntimeError(f"{data.request_id}: structured outputs without a grammar "
                                   "compiler (the engine checks this when the request is added)")
            matcher = self.grammar.matcher(spec)
            for t in data.output_token_ids:   # a continuation (P/D): where the producer stood
                if not matcher.accept(t):
                    logger.warning("%s: the grammar refused an earlier output token %d",
                                   data.request_id, t)
                    break
        self.seqs[data.request_id] = _SeqState(list(data.prompt_token_ids),
                                               list(data.output_token_ids), data.params, gen,
                                               matcher=matcher)

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Runs the step to the end: its new tokens (Executor.execute)."""
        return self.execute_async(out).result()

    @_own_device
    @torch.inference_mode()
    def execute_async(self, out: SchedulerOutput) -> StepHandle:
        """Starts the step (Executor.execute_async): the forward and sampling are queued on the
        device and the tokens' copy to the host started; the handle's result() waits for it.
        (Prompt logprobs are read here, at once.)"""
        tier = self.host_tier
        if tier is not None:   # (first: the previous step's loads before anything reads them)
            tier.begin_step()
        for rid in out.finished_ids:
            self.seqs.pop(rid, None)
        for data in out.new_requests:  # every rank: prompt logprobs need the params everywhere
            self._add(data)
        if out.kv_work is not None:
            self._kv_work(out.kv_work)
        moves = out.kv_moves
        if moves is not None and tier is None:
            raise ValueError("the step moves KV blocks to or from a host tier this runner "
                             "does not have (swap_space_gb is 0)")
        # Copy-on-write copies first: a copy's source, given back by it, may be a block the
        # moves load into in this step (apply() orders the moves after them).
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        if moves is not None:
            tier.apply(moves)   # beside this step's forward, which never reads its blocks
        if out.is_empty:
            # (no forward: e.g. a step of host-tier moves only; the step before stays the one
            # whose sampled tokens the next pending inputs read)
            return Ready({})
        last, self._last_sampled = self._last_sampled, None

        # Decode rows (one token) first: attention backends batch them.
        chunks = sorted(out.chunks, key=lambda c: len(c.token_ids) != 1)
        pending = self._pending_inputs(chunks, last)
        start = None
        if self.is_driver and self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        hidden, qsl = self._forward(chunks, pending)
        for i, c in enumerate(chunks):
            st = self.seqs.get(c.request_id)
            if st is not None and st.params.prompt_logprobs is not None and len(c.token_ids) > 1:
                self._prompt_logprobs_of(c, st, hidden[qsl[i]:qsl[i + 1]])

        rows: dict[str, int] = {}
        for i, c in enumerate(chunks):
            if c.sample:
                rows[c.request_id] = qsl[i + 1] - 1
        for f in out.forks:
            rows[f.request_id] = rows[f.parent_id]
        if not rows:
            self._step_timed(out.step_id, start)
            return Ready({})
        ids = list(rows)
        where = list(rows.values())
        first = where[0]
        if where == list(range(first, first + len(where))):
            # one run of rows (decode batches; a lone prompt's last row): a view, no upload
            picked = hidden[first: first + len(where)]
        else:
            picked = hidden[_to_device(where, self.device)]
        logits = self.model.compute_logits(picked)
        order = {rid: j for j, rid in enumerate(ids)}
        if not self.is_driver:
            if self.share_sampled:
                tokens = torch.empty(len(ids), dtype=torch.long, device=self.device)
                self._last_sampled = (get_tp_group().broadcast(tokens), order)
            return Ready({})
        seqs = [self.seqs[r] for r in ids]
        batch = SamplingBatch.build(
            [s.params for s in seqs], [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs], [s.generator for s in seqs],
            self.vocab_size, self.device, eos_token_ids=self.eos_token_ids,
            token_bitmask=self._token_bitmask(seqs))
        res = self.sampler(logits, batch)
        self._step_timed(out.step_id, start)
        if self.share_sampled:
            get_tp_group().broadcast(res.token_ids)
        self._last_sampled = (res.token_ids, order)
        want = [s.params.logprobs for s in seqs]
        lp = res.logprobs if any(w is not None for w in want) else None
        cuda = self.device.type == "cuda"
        host = tuple(None if t is None else _to_host(t, cuda)
                     for t in (res.token_ids, lp, res.topk_ids, res.topk_logprobs))
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self._last_result = StepResult(ids, seqs, want, host, event)
        return self._last_result

    def _token_bitmask(self, seqs: list[_SeqState]) -> torch.Tensor | None:
        """Structured outputs: the host bitmask of the rows about to be sampled (None when no
        row has a grammar). Runs while this step's forward is on the device; under async
        scheduling the step before may not have been read yet, so its tokens are read here
        first (a wait for that step only: this one's forward stays queued behind it)."""
        rows = [(s.matcher, j) for j, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return None
        if self._last_result is not None:
            self._last_result.result()     # advances the matchers by the previous tokens
        bitmask = torch.full((len(seqs), self.grammar.bitmask_words), -1, dtype=torch.int32,
                             pin_memory=self.device.type == "cuda")
        self.grammar.fill_bitmask(rows, bitmask)
        return bitmask

    def _pending_inputs(self, chunks, last) -> _PendingInputs | None:
        """The flat input positions of this step's pending tokens (each the last of its chunk)
        and their rows in the previous step's sampled tokens."""
        slots, rows = [], []
        end = 0
        for c in chunks:
            end += len(c.token_ids)
            if c.last_pending:
                if last is None or c.request_id not in last[1]:
                    raise RuntimeError(f"{c.request_id}: its chunk feeds a token the previous "
                                       "step did not sample")
                slots.append(end - 1)
                rows.append(last[1][c.request_id])
        if not slots:
            return None
        idx = _to_device([slots, rows], self.device)
        return _PendingInputs(idx[0], idx[1], last[0])

    @staticmethod
    def _write_pending(input_ids: torch.Tensor, pending: _PendingInputs | None) -> None:
        """Writes the previous step's sampled tokens into a step's input_ids (on the device,
        after they were staged, before the forward): every forward path calls this."""
        if pending is not None:
            input_ids.index_copy_(0, pending.slots, pending.tokens.index_select(0, pending.rows))

    def _step_timed(self, step_id: int, start: torch.cuda.Event | None) -> None:
        """The step's device work ends here (forward, prompt logprobs, logits and sampling):
        its end event after `start` (the driver on CUDA), or no time (the driver elsewhere)."""
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._gpu_pending.append((step_id, start, end))
        elif self.is_driver:
            self._gpu_settled[step_id] = None

    def take_gpu_times(self) -> dict[int, float | None]:
        """Step device times (ms, forward through sampling) by step id, of the steps whose end
        event has completed (Event.query: never a wait; once a step's result() returned, its
        sampling has completed); None for each step on CPU."""
        out, self._gpu_settled = self._gpu_settled, {}
        pending = self._gpu_pending
        while pending and pending[0][2].query():
            step_id, start, end = pending.popleft()
            out[step_id] = start.elapsed_time(end)
        return out

    def take_prompt_logprobs(self) -> dict[str, list[SampledToken]]:
        """Prompt-token logprobs computed since the last call, per sequence, in prompt order
        (entry j is prompt token j + 1 given tokens 0..j)."""
        out, self._prompt_logprobs = self._prompt_logprobs, {}
        return out

    def _prompt_logprobs_of(self, c, st: _SeqState, hidden: torch.Tensor) -> None:
        """Logits at prompt positions [lo, hi) predict prompt tokens lo+1 .. hi. A recomputed
        (preempted) prefill skips positions already done."""
        n_prompt = len(st.prompt_token_ids)
        lo = max(c.start_pos, st.prompt_logprobs_done)
        hi = min(c.start_pos + len(c.token_ids), n_prompt - 1)
        if lo >= hi:
            return
        k = st.params.prompt_logprobs
        found = self._prompt_logprobs.setdefault(c.request_id, [])
        for a in range(lo, hi, _PROMPT_LOGPROB_ROWS):
            b = min(hi, a + _PROMPT_LOGPROB_ROWS)
            logits = self.model.compute_logits(hidden[a - c.start_pos:b - c.start_pos])
            if not self.is_driver:
                continue  # the gather inside compute_logits needs every rank; sampling does not
            lp = torch.log_softmax(logits, dim=-1)
            target = _to_device(st.prompt_token_ids[a + 1:b + 1], lp.device)
            chosen = lp.gather(1, target[:, None])[:, 0].tolist()
            if k:
                top_lp, top_ids = lp.topk(k, dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.tolist())]
            else:
                tops = [None] * (b - a)
            found.extend(SampledToken(t, l, top) for t, l, top in
                         zip(st.prompt_token_ids[a + 1:b + 1], chosen, tops))
        st.prompt_logprobs_done = hi

    def _forward(self, chunks, pending: _PendingInputs | None = None
                 ) -> tuple[torch.Tensor, list[int]]:
        """Runs the model over the batch, as a CUDA-graph replay when one holds it, else eagerly
        (both over self.inputs); returns hidden states [T, hidden] and query_start_loc (host).
        pending: inputs that take the previous step's sampled tokens (_write_pending)."""
        lens = [len(c.token_ids) for c in chunks]
        plan = None
        if self.graphs is not None:
            plan = self.graphs.plan(sum(lens), len(chunks), max(lens),
                                    max(c.start_pos + n for c, n in zip(chunks, lens)))
        if plan is not None:
            staged = self.inputs.stage(chunks, plan.num_tokens, plan.num_seqs)
            self._write_pending(self.inputs.input_ids, pending)
            return self.graphs.replay(plan, staged.num_tokens), staged.query_start_loc
        staged = self.inputs.stage(chunks)
        self._write_pending(self.inputs.input_ids, pending)
        x, T, B = self.inputs, staged.num_tokens, staged.num_seqs
        meta = AttentionMetadata(
            slot_mapping=x.slot_mapping[:T], query_start_loc=x.query_start_loc[:B + 1],
            seq_lens=x.seq_lens[:B], block_tables=x.block_tables[:B],
            max_query_len=staged.max_query_len, max_seq_len=staged.max_seq_len,
            num_decodes=next((i for i, n in enumerate(lens) if n != 1), B),
            query_start_loc_host=staged.query_start_loc, seq_lens_host=staged.seq_lens)
        with forward_context(meta):
            hidden = self.model(x.input_ids[:T], x.positions[:T])
        return hidden, staged.query_start_loc


def _to_host(t: torch.Tensor, cuda: bool) -> torch.Tensor:
    """A host copy of t that lands without blocking (pinned; ready once the step's event is)."""
    if not cuda:
        return t
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t, non_blocking=True)
    return h


def _to_device(values: list, device: torch.device) -> torch.Tensor:
    """An int64 tensor of values on device, uploaded without waiting for the work queued there
    (through pinned memory: a pageable upload would wait for the step in flight)."""
    t = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)
