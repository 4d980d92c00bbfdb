"""LLMEngine: the engine-level API the offline LLM, the server, workers and the router drive.

    add_request(id, prompt, params)  -> validates, tokenizes, queues (ValueError on bad input)
    step()                           -> one forward; RequestOutputs of requests that advanced
    abort_request(id)                -> frees everything the request holds
    has_unfinished_requests()

It owns tokenization, detokenization and stop conditions; the Scheduler owns batching and blocks;
the ModelRunner owns tensors.
"""
from __future__ import annotations

import os
import time

import torch
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..config import EngineConfig
from ..devices import on_device
from ..protocol import (AddRequest, KVDrop, KVLoadDone, KVPeer, KVSend, KVSource, Prompt,
                        check_token_ids, parse_prompt)
from ..layers.parallel_state import get_tp_group
from ..loader.model_loader import ModelSource, load_model, load_tokenizer, resolve_source
from ..models.config import ModelConfig
from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..sampling_params import SamplingParams
from ..worker.model_runner import ModelRunner, SampledToken
from .detokenizer import IncrementalDetokenizer
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus
from .scheduler import Scheduler, SchedulerOutput

@dataclass(eq=False)
class _Seq:
    req: Request
    out: CompletionOutput
    detok: IncrementalDetokenizer | None
    reported_tokens: int = 0


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

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


def plan_kv_pool(config: EngineConfig, model) -> tuple[int, int]:
    """(num_blocks, max_model_len) for this model and budget. Under TP every rank calls it and the
    smallest budget wins, so all ranks build the same pool."""
    mcfg = model.config
    attn = model.layers[0].self_attn
    bytes_per_block = (2 * mcfg.num_layers * attn.num_kv_heads * attn.head_dim
                       * config.block_size * config.torch_dtype.itemsize)
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    else:
        budget = torch.tensor([_kv_budget_bytes(config)], dtype=torch.int64,
                              device=config.torch_device)
        get_tp_group().all_reduce(budget, op=torch.distributed.ReduceOp.MIN)
        num_blocks = max(1, int(budget.item()) // bytes_per_block)
    _check_pool_fits(config, num_blocks, bytes_per_block)
    capacity = num_blocks * config.block_size
    if config.max_model_len is not None and config.max_model_len > capacity:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the KV pool "
                         f"({num_blocks} blocks x {config.block_size} = {capacity} tokens)")
    max_model_len = config.max_model_len or min(mcfg.max_position_embeddings, capacity)
    if max_model_len > mcfg.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context "
                         f"length {mcfg.max_position_embeddings}")
    return num_blocks, max_model_len


def _check_pool_fits(config: EngineConfig, num_blocks: int, bytes_per_block: int) -> None:
    """A pool the device cannot hold is a ValueError naming what sized it, not an allocator
    error from inside torch. The bound is what certainly fails: all of the machine's memory on
    CPU, the GPU's free memory (after the weights) on CUDA."""
    need = (num_blocks + 1) * bytes_per_block  # + the scratch block
    device = config.torch_device
    if device.type == "cuda":
        have, where = torch.cuda.mem_get_info(device)[0], f"the free memory of {device}"
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        where = "this machine's memory"
    if need <= have:
        return
    if config.num_kv_blocks:
        cause = f"num_kv_blocks={config.num_kv_blocks}"
    elif config.kv_cache_memory_gb is not None:
        cause = f"kv_cache_memory_gb={config.kv_cache_memory_gb}"
    else:  # the default budget, or a block bigger than it (the pool has at least one)
        cause = f"block_size={config.block_size} and the default KV budget"
    raise ValueError(f"the KV pool does not fit: {num_blocks} blocks (+1 scratch) of "
                     f"{config.block_size} tokens take {need / (1 << 30):.1f} GiB, more than "
                     f"{where} ({have / (1 << 30):.1f} GiB); set by {cause}")


def _kv_budget_bytes(cfg: EngineConfig) -> int:
    if cfg.kv_cache_memory_gb is not None:
        return int(cfg.kv_cache_memory_gb * (1 << 30))
    if cfg.torch_device.type == "cuda":
        free, total = torch.cuda.mem_get_info(cfg.torch_device)
        used = total - free
        # Leave room for activations and CUDA graphs: they are not in the budget yet.
        return max(0, int(total * cfg.gpu_memory_utilization) - used - (2 << 30))
    return 1 << 30


def build_model_runner(config: EngineConfig, eos_token_ids: tuple[int, ...] = (),
                       source: ModelSource | None = None, kv_dir: str | None = None
                       ) -> tuple[ModelRunner, int, int]:
    """Loads this rank's shard of the model and builds its runner and KV pool (every TP rank
    runs this; the tp group must be initialised first). kv_dir: where a KV connector may put
    files (CPU pools shared with other workers). Returns (runner, num_blocks, max_model_len)."""
    source = source or resolve_source(config.model)
    device, dtype = config.torch_device, config.torch_dtype
    with on_device(device):  # Triton kernels (loading, warm-up, graph capture) run there
        model = load_model(source, config.load_format, dtype, device,
                           config.resolved_attention_backend, config.seed)
        num_blocks, max_model_len = plan_kv_pool(config, model)
        runner = ModelRunner(
            model, num_blocks, config.block_size, dtype, device, config.seed, eos_token_ids,
            max_model_len,
            min(config.cuda_graph_max_batch, config.max_num_seqs) if config.use_cuda_graphs else 0,
            is_driver=get_tp_group().is_driver, kv_connector=config.kv_connector,
            kv_path=None if kv_dir is None else f"{kv_dir}/kv-rank{get_tp_group().rank}",
            kv_sync=config.kv_transfer_mode == "sync")
    return runner, num_blocks, max_model_len


def kv_export(runner: ModelRunner, worker: str) -> KVPeer:
    """This worker's KV pools as a consumer needs them (every TP rank calls it: the handles are
    gathered from all ranks)."""
    tp = get_tp_group()
    handles = tp.all_gather_object(runner.connector.export())
    return KVPeer(worker, runner.connector.name, tp.size, runner.model.config.num_kv_heads, handles)


class LLMEngine:
    """on_schedule: called with every SchedulerOutput before this process runs it (a TP driver
    sends it to the other ranks there)."""

    def __init__(self, config: EngineConfig,
                 on_schedule: Callable[[SchedulerOutput], None] | None = None,
                 kv_dir: str | None = None):
        self.config = config
        source = resolve_source(config.model)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(source)
        if self.tokenizer is not None:
            eos_ids = tuple(sorted(self.tokenizer.stop_token_ids))
        else:
            eos = ModelConfig.from_hf(source.hf_config).eos_token_id
            eos_ids = tuple(eos) if isinstance(eos, tuple) else (() if eos is None else (eos,))
        self.eos_token_ids = eos_ids
        if config.kv_connector is not None and kv_dir is None:
            import tempfile
            kv_dir = tempfile.mkdtemp(prefix="pdserve-kv-")
        self.runner, self.num_kv_blocks, self.max_model_len = build_model_runner(
            config, eos_ids, source, kv_dir)
        self.model = self.runner.model
        self.model_config = self.model.config
        self.kv = KVCacheManager(self.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_kv_loads)
        if self.runner.connector is not None and self.runner.connector.two_sided:
            self.scheduler.discard_unloaded = True
        self._load_started: dict[str, float] = {}   # P/D consumer: pulls in flight, since when
        self._kv_events: list[KVLoadDone] = []
        self._on_schedule = on_schedule
        self._groups: dict[str, _Group] = {}
        self._seq_group: dict[str, tuple[_Group, _Seq]] = {}

    # ---- requests ---------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, final_only: bool = False,
                    kv_hold: bool = False, kv_source: KVSource | None = None) -> None:
        """Queue a request. final_only: step() reports it once, when it finishes, instead of
        after every token (what an offline batch wants; streaming leaves it False).
        P/D: kv_hold keeps its KV when it finishes (the output's kv_transfer says where);
        kv_source continues a request whose prompt KV waits on a producer."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n > self.config.max_num_seqs:  # its sequences are admitted together
            raise ValueError(f"n={params.n} is more than max_num_seqs={self.config.max_num_seqs} "
                             "sequences can run at once")
        # (SamplingParams checked that they are integers >= 0; the vocabulary is known here)
        check_token_ids("stop_token_ids", params.stop_token_ids, self.model_config.vocab_size)
        text, ids = self.tokenize_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             "(room for at least one generated token is needed)")
        done_ids: list[int] = []
        if kv_hold or kv_source is not None:
            self._check_kv_request(ids, params, kv_source)
            if kv_source is not None:
                done_ids = list(kv_source.output_token_ids)
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            req = Request(f"{request_id}#{i}", ids, params, seed, self.max_model_len,
                          output_token_ids=list(done_ids), hold_kv=kv_hold)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                               tuple(params.stop or ()))
                for t in done_ids:  # the producer reported these already
                    detok.add(t)
                detok.take_new_text(False)
            # token_ids is the request's own output list: the scheduler appends, nobody copies.
            seqs.append(_Seq(req, CompletionOutput(i, "", req.output_token_ids,
                                                   [] if params.logprobs is not None else None),
                             detok, reported_tokens=len(done_ids)))
        first = seqs[0].req
        for s in seqs[1:]:
            s.req.status = RequestStatus.FORK_PENDING
            first.siblings.append(s.req)
        group = _Group(request_id, text, ids, params, seqs, final_only,
                       {"arrival": arrival_time or time.monotonic()}, num_unfinished=len(seqs),
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        if kv_source is not None and not kv_source.lost:
            self.scheduler.add_remote(first, kv_source)
        else:  # (a lost kv_source: computed here from the prompt, after its output tokens)
            self.scheduler.add(first)
        self._groups[request_id] = group
        for s in seqs:
            self._seq_group[s.req.request_id] = (group, s)

    def add_requests(self, requests: list[AddRequest]) -> list[str | None]:
        """Queues each request; returns, per request, None or why it was rejected (the others
        are queued regardless)."""
        errors: list[str | None] = []
        for r in requests:
            try:
                self.add_request(r.request_id, r.prompt, r.params, r.arrival_time, r.final_only,
                                 r.kv_hold, r.kv_source)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        return errors

    def _check_kv_request(self, ids: list[int], params: SamplingParams,
                          kv_source: KVSource | None) -> None:
        if self.runner.connector is None and kv_source is not None and not kv_source.lost:
            raise ValueError("this engine has no kv_connector: it cannot pull KV")
        if params.n != 1 or params.prompt_logprobs is not None:
            raise ValueError("a P/D request needs n=1 and no prompt_logprobs")
        if kv_source is None:
            return
        if kv_source.num_tokens != len(ids):
            raise ValueError(f"kv_source covers {kv_source.num_tokens} tokens; the prompt has "
                             f"{len(ids)}")
        if not kv_source.lost and len(kv_source.block_ids) != self.kv.blocks_for(kv_source.num_tokens):
            raise ValueError(f"kv_source has {len(kv_source.block_ids)} blocks for "
                             f"{kv_source.num_tokens} tokens (block size {self.config.block_size})")
        if not kv_source.output_token_ids or not all(
                0 <= t < self.model_config.vocab_size for t in kv_source.output_token_ids):
            raise ValueError("kv_source needs the producer's sampled token(s), in the vocabulary")
        if len(ids) + len(kv_source.output_token_ids) >= self.max_model_len:
            raise ValueError("the request does not fit max_model_len here")

    # ---- P/D --------------------------------------------------------------------------------
    def kv_export(self, worker: str) -> KVPeer:
        return kv_export(self.runner, worker)

    def connect_kv(self, peers: list[KVPeer]) -> None:
        """Make producers reachable (checked here first; every rank adds them next step)."""
        if self.runner.connector is None:
            raise ValueError("this engine has no kv_connector")
        for p in peers:
            self.runner.connector.check_peer(p)  # ValueError on a mismatched layout
            self.scheduler.add_kv_peer(p)

    def drop_kv_peer(self, worker: str) -> None:
        """A peer worker is gone: every rank aborts its pair with it next step (two-sided
        connectors; the others have nothing to abort)."""
        if self.runner.connector is not None:
            self.scheduler.add_kv_peer(KVDrop(worker))

    def send_kv(self, sends: list[KVSend]) -> None:
        """Two-sided producer: send held KV to consumers (next step, every rank), then drop the
        hold. A request no longer held is still sent (its block count), marked invalid, so
        the consumer's receives stay in step; it recomputes that one."""
        for s in sends:
            held = self.kv.held.get(f"{s.request_id}#0")
            ok = held is not None and len(held[0]) == len(s.block_ids)
            blocks = list(held[0]) if ok else [0] * len(s.block_ids)  # filler: block 0
            self.scheduler.add_kv_send(KVSend(s.request_id, s.consumer, blocks, ok))
            # the runner reads the blocks before any later forward writes them
            self.kv.release_held(f"{s.request_id}#0")

    def release_kv(self, request_ids: Iterable[str]) -> None:
        """A producer's held KV is no longer needed (pulled, or the request went elsewhere)."""
        for rid in request_ids:
            self.kv.release_held(f"{rid}#0")

    def expire_held_kv(self, now: float | None = None) -> int:
        """Releases KV held longer than kv_hold_timeout_s (a consumer that never pulled)."""
        now = time.monotonic() if now is None else now
        old = [rid for rid, (_, t) in self.kv.held.items()
               if now - t > self.config.kv_hold_timeout_s]
        for rid in old:
            self.kv.release_held(rid)
        return len(old)

    def take_kv_events(self) -> list[KVLoadDone]:
        out, self._kv_events = self._kv_events, []
        return out

    def _finish_loads(self) -> None:
        # (a load given up on, or aborted, may still report when its copy stops: not news)
        done = [d for d in self.runner.poll_loads() if d.request_id in self._load_started]
        now = time.monotonic()
        for d in done:
            del self._load_started[d.request_id]
        limit = self.config.kv_transfer_timeout_s
        for rid, t in list(self._load_started.items()):
            if now - t > limit:
                del self._load_started[rid]
                done.append(KVLoadDone(rid, False, 0, now - t, f"timed out after {limit:g} s"))
        if done:
            self.scheduler.finish_loads(done)
            for d in done:
                rid = d.request_id.rsplit("#", 1)[0]
                self._kv_events.append(KVLoadDone(rid, d.ok, d.nbytes, d.seconds, d.error))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            for s in group.seqs:
                self.scheduler.finish(s.req, RequestStatus.FINISHED_ABORTED)
                self._seq_group.pop(s.req.request_id, None)
                self._load_started.pop(s.req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if self._on_schedule is not None:
            self._on_schedule(sched)
        sampled = self.runner.execute(sched)
        for load in sched.kv_loads:
            if load.dst_block_ids:  # (not a receive-and-discard)
                self._load_started[load.request_id] = time.monotonic()
        if self._load_started:
            self._finish_loads()
            if sched.is_empty and not sampled:
                time.sleep(2e-4)  # only pulls in flight: don't spin on the poll
        for rid, entries in self.runner.take_prompt_logprobs().items():
            group = self._seq_group[rid][0]
            group.prompt_logprobs.extend(self._logprob_entry(tok) for tok in entries)
        advanced = self.scheduler.update({k: v.token_id for k, v in sampled.items()})
        now = time.monotonic()
        touched: dict[str, _Group] = {}
        for req in advanced:
            group, seq = self._seq_group[req.request_id]
            self._append(group, seq, sampled[req.request_id])
            if "first_token" not in group.metrics:
                group.metrics["first_token"] = now
            if not group.final_only or group.finished:
                touched[group.request_id] = group
        return [self._make_output(group, now) for group in touched.values()]

    def _append(self, group: _Group, seq: _Seq, tok: SampledToken) -> None:
        req, out, p = seq.req, seq.out, group.params  # the scheduler already appended the token
        if out.logprobs is not None:
            out.logprobs.append(self._logprob_entry(tok))
        stop_str = seq.detok.add(tok.token_id) if seq.detok is not None else None
        n_out = len(req.output_token_ids)
        status, reason = None, None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok.token_id in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif tok.token_id in p.stop_token_ids:
                status, reason = RequestStatus.FINISHED_STOPPED, tok.token_id
            elif stop_str is not None:
                status, reason = RequestStatus.FINISHED_STOPPED, stop_str
        if status is None and (n_out >= p.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            out.finish_reason, out.stop_reason = status.value, reason
            held = self.scheduler.finish(req, status, time.monotonic())
            if held is not None:  # P/D producer: where a consumer finds this prompt's KV
                group.kv_transfer = KVSource("", group.request_id, held, req.num_computed_tokens,
                                             list(req.output_token_ids))
            group.num_unfinished -= 1

    def _logprob_entry(self, tok: SampledToken) -> dict[int, Logprob]:
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
        finished = group.finished
        if finished:
            group.metrics["finished"] = now
            del self._groups[group.request_id]
            for s in group.seqs:
                self._seq_group.pop(s.req.request_id, None)
        outs = []
        for s in group.seqs:
            o = s.out
            o.new_token_ids = o.token_ids[s.reported_tokens:]
            s.reported_tokens = len(o.token_ids)
            if s.detok is not None:
                o.new_text = s.detok.take_new_text(o.finished)
                o.text = s.detok.text if o.finished else s.detok.text[: s.detok.reported]
            outs.append(CompletionOutput(o.index, o.text, list(o.token_ids),
                                         None if o.logprobs is None else list(o.logprobs),
                                         o.finish_reason, o.stop_reason, o.new_token_ids, o.new_text))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, finished,
                             dict(group.metrics),
                             None if group.prompt_logprobs is None else list(group.prompt_logprobs),
                             group.kv_transfer)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
