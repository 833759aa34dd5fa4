"""jaxserve: LLM inference on JAX with a paged KV cache and continuous batching.

`from jaxserve import LLM, SamplingParams` is the offline API (vLLM's names). The names are loaded
on first use, so that importing one part (`jaxserve.sample`, `jaxserve.config`) loads only what
it imports.
"""

from __future__ import annotations

import importlib

from jaxserve.host_memory import reuse_freed_memory

reuse_freed_memory()  # (before JAX's CPU client starts its threads)

_EXPORTS = {
    "LLM": "jaxserve.llm",
    "LLMEngine": "jaxserve.llm_engine",
    "EngineArgs": "jaxserve.config.engine_args",
    "Engine": "jaxserve.engine.core",
    "EngineConfig": "jaxserve.config.engine",
    "RequestOutput": "jaxserve.engine.outputs",
    "CompletionOutput": "jaxserve.engine.outputs",
    "HiddenStates": "jaxserve.engine.outputs",
    "PoolingParams": "jaxserve.engine.pooling",
    "EmbeddingRequestOutput": "jaxserve.engine.pooling",
    "Logprob": "jaxserve.engine.outputs",
    "TextPrompt": "jaxserve.engine.inputs",
    "TokensPrompt": "jaxserve.engine.inputs",
    "SamplingParams": "jaxserve.sample.params",
    "LoRARequest": "jaxserve.config.lora",
    "RequestOutputKind": "jaxserve.sample.params",
    "BeamSearchParams": "jaxserve.engine.beam_search",
    "LogitsProcessor": "jaxserve.sample.logits_processors",
    "StructuredOutputsParams": "jaxserve.structured_output.grammar",
    "GuidedDecodingParams": "jaxserve.structured_output.grammar",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
