"""jaxserve: LLM inference on JAX with a paged KV cache and continuous batching.

`from jaxserve import LLM, SamplingParams` is the offline API (vLLM's names).
"""

from jaxserve.beam_search import BeamSearchParams
from jaxserve.config import EngineConfig
from jaxserve.engine import Engine
from jaxserve.inputs import TextPrompt, TokensPrompt
from jaxserve.llm import LLM
from jaxserve.logits_processors import LogitsProcessor
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.structured import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob", "TextPrompt",
           "TokensPrompt", "SamplingParams", "RequestOutputKind", "BeamSearchParams", "StructuredOutputsParams",
           "GuidedDecodingParams", "LogitsProcessor"]
