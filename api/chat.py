"""POST /v1/chat/completions (OpenAI's chat API, with vLLM's extras), and vLLM's (SageMaker's)
POST /invocations, which serves a chat or a completions body."""

from __future__ import annotations

from quart import Blueprint, Response
from quart_schema import document_request, document_response

from api.answer import answer
from api.chat_models import ChatCompletionRequest
from api.completions import complete
from api.errors import APIError
from api.generation import request_ids
from api.protocol import parse_chat
from api.response_models import ChatCompletion
from api.state import api_state, json_body

chat = Blueprint("chat", __name__)


async def chat_complete(body: dict) -> Response | ChatCompletion:
    """The answer to a chat completions request body."""
    state = api_state()
    request_id, shown = request_ids("chatcmpl", body)
    req = await state.off_loop(parse_chat, body, state.limits, state.text_tokenizer("chat"))
    return await answer(state, req, request_id, chat=True, shown=shown)


@chat.post("/v1/chat/completions")
@document_request(ChatCompletionRequest)
@document_response(ChatCompletion)
async def create_chat_completion():
    """The assistant's answer to the messages; with `"stream": true`, server-sent ChatCompletionChunks."""
    return await chat_complete(await json_body())


@chat.post("/invocations")
async def invocations():
    """Chat where the body has messages, else completions."""
    body = await json_body()
    if "messages" in body:
        return await chat_complete(body)
    if "prompt" in body:
        return await complete(body)
    raise APIError("/invocations takes a chat request (with 'messages') or a completions request (with 'prompt')")
