"""pdserve: a compact LLM serving engine built for prefill/decode disaggregation.

The public names load on first use, so that importing a torch-free part of the package
(pdserve.engine, pdserve.routing's core, pdserve.perf, pdserve.protocol) does not import torch."""
from __future__ import annotations

import importlib

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

_WHERE = {"LLM": ".entrypoints.llm", "AsyncLLM": ".entrypoints.async_llm",
          "SamplingParams": ".sampling_params", "StructuredOutputsParams": ".sampling_params",
          "RequestOutput": ".outputs", "CompletionOutput": ".outputs", "Logprob": ".outputs"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
