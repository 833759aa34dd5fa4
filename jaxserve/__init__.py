"""jaxserve: LLM inference on JAX with a paged KV cache and continuous batching.

`from jaxserve import LLM, SamplingParams` is the offline API. The names are
resolved lazily so that `checkpoints` (which needs `jaxserve.config`) and
`jaxserve.llm` (which needs `checkpoints`) can import each other's modules.
"""

import importlib

_EXPORTS = {
    "LLM": "jaxserve.llm",
    "Engine": "jaxserve.engine",
    "EngineConfig": "jaxserve.config",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "Logprob": "jaxserve.outputs",
    "TextPrompt": "jaxserve.inputs",
    "TokensPrompt": "jaxserve.inputs",
    "SamplingParams": "jaxserve.sampling_params",
    "RequestOutputKind": "jaxserve.sampling_params",
    "BeamSearchParams": "jaxserve.beam_search",
    "StructuredOutputsParams": "jaxserve.structured",
    "GuidedDecodingParams": "jaxserve.structured",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
