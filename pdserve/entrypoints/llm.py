"""LLM: the offline batch API (vLLM-compatible shapes) over LLMEngine."""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from ..config import EngineConfig
from ..args import DeploymentArgs
from ..deploy import build
from ..loader.generation_config import generation_defaults
from ..worker.llm_engine import LLMEngine
from ..protocol import AddRequest, Prompt
from ..outputs import RequestOutput
from ..routing.client import EngineProtocol
from ..sampling_params import SamplingParams


# LLM(...) keyword arguments that describe a deployment (several workers behind a router)
_DEPLOYMENT_ARGS = {f.name for f in dataclasses.fields(DeploymentArgs)} - {"kv_connector"}


def split_engine_args(model: str | None, engine_args: dict[str, Any]
                      ) -> tuple[EngineConfig, DeploymentArgs | None]:
    """LLM's (and AsyncLLM's) keyword arguments: the engine's config and, when any deployment
    argument is among them, the deployment (None: none given)."""
    deploy = {k: engine_args.pop(k) for k in _DEPLOYMENT_ARGS if k in engine_args}
    return EngineConfig(model=model, **engine_args), DeploymentArgs(**deploy) if deploy else None


class LLM:
    """LLM(model=None, **engine_args): model is an HF folder, a .gguf file or a preset name
    (with load_format="dummy"); None loads the embedded SmolLM2-135M-Instruct. Engine args are
    EngineConfig's fields (dtype, device, block_size, max_num_seqs, max_num_batched_tokens,
    max_model_len, seed, num_kv_blocks, kv_cache_memory_gb, load_format, skip_tokenizer_init,
    tensor_parallel_size, distributed_executor_backend, swap_space_gb, preemption_mode and
    kv_offload_policy for
    the KV cache's host tier, ...).

    P/D disaggregation: prefill=N, decode=M (and/or collocated=K) start that many workers, each
    its own processes and TP group (prefill_tp / decode_tp / collocated_tp), behind a Router
    that picks a path per request (routing_policy: "disagg", "collocated", "round-robin", or
    "adaptive": the path a cost model predicts meets slo_ttft_ms / slo_tpot_ms, with
    cost_model= a `pdserve profile` file, a CostProfile or its dict; see deploy.adaptive_policy
    for what happens without one); a
    worker that dies is restarted up to worker_restarts times in a row (default 3; 0: never),
    the first after restart_backoff_s seconds (default 1), doubling.

    With tensor_parallel_size > 1 (or distributed_executor_backend="mp") the engine runs in
    worker processes and llm_engine is an EngineClient with the same request API; call
    shutdown() (or use `with LLM(...) as llm:`) to stop them, else they stop at exit.

    generation_config ("auto", "vllm" or a folder, as `--generation-config`): where the
    sampling values of generate() / chat() called without SamplingParams come from
    (get_default_sampling_params)."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        config, deployment = split_engine_args(model, engine_args)
        # (read before the engine starts: a bad folder fails at once)
        self._default_sampling = generation_defaults(config.generation_config, config.model)[0]
        self.llm_engine: LLMEngine | EngineProtocol = build(config, deployment)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use when given no SamplingParams (vLLM's): the model's
        generation config's values (generation_config="auto" or a folder), else
        SamplingParams()."""
        return SamplingParams(**self._default_sampling)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix that no request in flight uses (vLLM's name);
        returns the KV blocks freed."""
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops worker processes (a no-op for an in-process engine)."""
        self.llm_engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling params must be SamplingParams, got {type(p).__name__}")
        engine = self.llm_engine
        reqs = [AddRequest(str(next(self._ids)), prompt, p, final_only=True)
                for prompt, p in zip(prompts, params)]
        errors = engine.add_requests(reqs)
        bad = next((e for e in errors if e is not None), None)
        if bad is not None:
            # a bad prompt rejects the whole call, nothing half-run
            engine.abort_request([r.request_id for r, e in zip(reqs, errors) if e is None])
            raise ValueError(bad)
        return self._run([r.request_id for r in reqs], use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer (this LLM was built with skip_tokenizer_init)")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": tok.apply_chat_template(c, add_generation_prompt, tokenize=True)}
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, n_out = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():  # final_only: each request reports once, finished
                    n_out += sum(len(o.token_ids) for o in out.outputs)
                    done[out.request_id] = out
                    bar.update(1)
                    bar.set_postfix_str(f"output {n_out / (time.perf_counter() - start):.1f} tok/s",
                                        refresh=False)
        finally:
            bar.close()
        return [done[i] for i in ids]
