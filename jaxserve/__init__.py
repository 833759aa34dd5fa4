"""jaxserve: LLM inference on JAX with a paged KV cache and continuous batching."""

from jaxserve.engine import LLM, CompletionOutput, Engine, RequestOutput
from jaxserve.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Engine", "RequestOutput", "SamplingParams"]
