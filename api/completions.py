"""POST /v1/completions: OpenAI's legacy completions (and vLLM's extras) over the engine."""

from __future__ import annotations

from quart import Blueprint, Response
from quart_schema import document_request, document_response

from api.answer import answer
from api.generation import request_ids
from api.protocol import parse_completion
from api.request_models import CompletionRequest
from api.response_models import Completion
from api.state import api_state, json_body

completions = Blueprint("completions", __name__)


async def complete(body: dict) -> Response | Completion:
    """The answer to a completions request body."""
    state = api_state()
    request_id, shown = request_ids("cmpl", body)
    req = await state.off_loop(parse_completion, body, state.limits, state.tokenizer)
    return await answer(state, req, request_id, chat=False, shown=shown)


@completions.post("/v1/completions")
@document_request(CompletionRequest)
@document_response(Completion)
async def create_completion():
    """A completion of each prompt; with `"stream": true`, server-sent CompletionChunks."""
    return await complete(await json_body())
