"""LLMEngine: the engine in this process — an EngineCore (engine/core.py: scheduler, KV
coordinator, output processor; plain Python) driving this rank's ModelRunner. What it adds is
the assembly (the tokenizer, the model shard, the KV pool: build.py) and the P/D calls that need
the connector (kv_export, connect_kv, drop_kv_peer). The offline LLM runs it directly; a worker
process runs it on rank 0 (worker.py).

It lives beside the runner, not in engine/, because it builds torch objects; entrypoints/ and the
worker both import it from here (downwards).
"""
from __future__ import annotations

import tempfile
from typing import Callable

from ..config import EngineConfig
from ..engine.core import EngineCore
from ..engine.scheduler import SchedulerOutput
from ..loader.model_loader import engine_tokenizer, resolve_source
from ..models.config import ModelConfig
from ..protocol import KVDrop, KVPeer
from ..sampling_params import SamplingParams
from ..structured.grammar import GrammarCompiler
from .build import build_model_runner, kv_export


class LLMEngine(EngineCore):
    """on_schedule: called with every SchedulerOutput before this process runs it (a TP driver
    sends it to the other ranks there). kv_dir: where a KV connector may put files (a fresh
    temporary folder when there is a kv_connector and none is given). delta_outputs: step()
    reports deltas (a worker's channel to its client: engine/output_processor.py)."""

    def __init__(self, config: EngineConfig,
                 on_schedule: Callable[[SchedulerOutput], None] | None = None,
                 kv_dir: str | None = None, delta_outputs: bool = False):
        source = resolve_source(config.model)
        tokenizer = engine_tokenizer(config, source)
        if tokenizer is not None:
            eos_ids = tuple(sorted(tokenizer.stop_token_ids))
        else:
            eos = ModelConfig.from_hf(source.hf_config).eos_token_id
            eos_ids = tuple(eos) if isinstance(eos, tuple) else (() if eos is None else (eos,))
        if config.kv_connector is not None and kv_dir is None:
            kv_dir = tempfile.mkdtemp(prefix="pdserve-kv-")
        runner, num_kv_blocks, max_model_len = build_model_runner(config, eos_ids, source, kv_dir)
        self.runner = runner
        self.model = runner.model
        self.model_config = self.model.config
        # structured outputs: checked here when a request is added, matched in the runner
        self.grammar = None
        if tokenizer is not None and eos_ids:
            self.grammar = GrammarCompiler(tokenizer, self.model_config.vocab_size, eos_ids)
        runner.grammar = self.grammar
        conn = runner.connector
        tier = runner.host_tier
        super().__init__(config, runner, num_kv_blocks=num_kv_blocks,
                         max_model_len=max_model_len, vocab_size=self.model_config.vocab_size,
                         eos_token_ids=eos_ids, tokenizer=tokenizer,
                         kv_transfer=conn is not None,
                         two_sided=conn is not None and conn.two_sided, on_schedule=on_schedule,
                         num_host_blocks=0 if tier is None else tier.num_host_blocks,
                         host_copy_gb_per_s=0.0 if tier is None else tier.copy_gb_per_s,
                         kv_block_bytes=runner.kv_block_bytes, delta_outputs=delta_outputs)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    *args, **kwargs) -> None:
        """EngineCore.add_request, and a structured-outputs constraint compiled first (its
        ValueError says why the grammar engine cannot)."""
        spec = getattr(params, "structured_outputs", None)
        if spec is not None:
            if self.grammar is None:
                raise ValueError("structured outputs need the model's tokenizer (this engine "
                                 "was started without one: skip_tokenizer_init)")
            self.grammar.check(spec)
        super().add_request(request_id, prompt, params, *args, **kwargs)

    def shutdown(self, timeout_s: float = 0.0) -> None:
        """The EngineProtocol's stop: an in-process engine has no processes to stop (its
        memory goes with the object), so this only exists for callers that drive any engine
        the same way."""

    # ---- P/D: what needs the connector ------------------------------------------------------
    def kv_export(self, worker: str) -> KVPeer:
        return kv_export(self.runner, worker)

    def connect_kv(self, peers: list[KVPeer]) -> None:
        """Make producers reachable (checked here first; every rank adds them next step)."""
        if self.runner.connector is None:
            raise ValueError("this engine has no kv_connector")
        for p in peers:
            self.runner.connector.check_peer(p)  # ValueError on a mismatched layout
            self.add_kv_peer(p)

    def drop_kv_peer(self, worker: str) -> None:
        """A peer worker is gone: every rank aborts its pair with it next step (two-sided
        connectors; the others have nothing to abort)."""
        if self.runner.connector is not None:
            self.add_kv_peer(KVDrop(worker))
