"""pdserve: a compact LLM serving engine built for prefill/decode disaggregation."""
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM (torch, the model runner, worker processes) is imported on first use, so that the
    # plain-Python parts (pdserve.engine, pdserve.protocol, ...) import without torch.
    if name == "LLM":
        from .entrypoints.llm import LLM
        return LLM
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
