"""POST /v1/embeddings: OpenAI's embeddings (and vLLM's extras) from a decoder served with --runner
pooling (`jaxserve/engine/pooling.py`): each input is a prompt of the same scheduler, pooled."""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict
from quart import Blueprint
from quart_schema import document_request, document_response

from api.errors import APIError
from api.fields import (
    STRING,
    STRINGS,
    TOKEN_IDS,
    Bool,
    Str,
    checked,
    integer,
    validated,
)
from api.generation import admit, generation
from api.limits import check_model
from api.protocol import GenerationRequest, as_run
from api.request_models import read_prompts
from api.response_models import Wire
from api.sse import new_id
from api.state import api_state, json_body
from jaxserve.engine.pooling import PoolingParams
from jaxserve.errors import RequestError
from jaxserve.sample.residual import encode_array

embeddings = Blueprint("embeddings", __name__)
MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings."""
    model_config = ConfigDict(extra="allow", frozen=True, json_schema_extra={"required": ["input"]})

    model: Str = None
    input: checked(list[str] | list[list[int]], read_prompts, {"anyOf": [
        STRING, STRINGS, TOKEN_IDS, {"type": "array", "items": TOKEN_IDS}]}, "input") = None
    encoding_format: checked(str, lambda name, v: v if v in ("float", "base64") else _bad_format(v), STRING,
                             "encoding_format", "float (the default) or base64 (little-endian float32)") = None
    dimensions: integer(1, 1 << 20) = None
    user: Str = None
    truncate_prompt_tokens: integer(-1, 1 << 20) = None  # vLLM's
    add_special_tokens: Bool = None  # vLLM's (default true)
    normalize: Bool = None  # vLLM's: over the server's pooling


def _bad_format(value):
    raise ValueError(f"'encoding_format' must be float or base64, got {value!r}")


class Embedding(Wire):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(Wire):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Wire):
    id: str
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


@embeddings.post("/v1/embeddings")
@document_request(EmbeddingRequest)
@document_response(EmbeddingResponse)
async def create_embeddings():
    """The embedding of each input: a string, a list of strings, token ids or lists of them."""
    state, body = api_state(), await json_body()
    model = check_model(body.get("model"), state.limits)
    request = validated(EmbeddingRequest, body)
    if request.input is None:
        raise APIError("'input' is required", param="input")
    if len(request.input) > MAX_INPUTS:
        raise APIError(f"'input' holds {len(request.input)} inputs, at most {MAX_INPUTS}", param="input")
    pooler = state.limits.pooler
    pooling = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
    if pooler is not None:  # (a generative server refuses the request in `admit`, whatever it asks)
        try:
            pooling.check(state.limits.hidden_size)
        except RequestError as e:
            raise APIError(str(e), param="dimensions") from e
    params = None if pooler is None else dataclasses.replace(pooler.params(),
                                                             truncate_prompt_tokens=request.truncate_prompt_tokens)
    ids = []
    for text in request.input:
        if isinstance(text, str) and state.tokenizer is None:
            raise APIError("text inputs need the model's tokenizer (the server runs without one): send token ids",
                           param="input")
        tokens = state.tokenizer.encode(text, add_special_tokens=request.add_special_tokens is not False) \
            if isinstance(text, str) else list(text)
        ids.append(tokens if params is None else as_run(tokens, state.limits, params)[0])
    req = GenerationRequest(ids, [""] * len(ids), params, stream=False, include_usage=False, model=model,
                            prompt_field="input", pooling=True)
    request_id = new_id("embd")
    req = await admit(state, req, request_id, chat=False)
    vectors: dict[int, list] = {}
    async for i, update in generation(state, req, request_id):
        if update.hidden_states is not None:
            vector = pooler.pool(update.hidden_states, pooling)
            vectors[i] = encode_array(vector) if request.encoding_format == "base64" else vector.tolist()
    tokens = sum(map(len, req.prompts))
    return EmbeddingResponse(id=request_id, model=model, data=[Embedding(index=i, embedding=vectors[i])
                                                               for i in range(len(ids))],
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)).dump()
