"""vLLM's POST /tokenize (a prompt, or chat messages as the chat template renders them) and
POST /detokenize."""

from __future__ import annotations

from quart import Blueprint

from api.errors import APIError
from api.limits import check_model
from api.protocol import parse_chat
from api.response_models import DetokenizeResponse, TokenizeResponse
from api.state import api_state, json_body

tokenize = Blueprint("tokenize", __name__)

# the chat request fields that shape the rendered prompt
RENDERING_FIELDS = ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
                    "chat_template_kwargs", "add_special_tokens", "reasoning_effort")


@tokenize.post("/tokenize")
async def tokenize_text():
    state, body = api_state(), await json_body()
    limits, tokenizer = state.limits, state.text_tokenizer("/tokenize")
    check_model(body.get("model"), limits)
    if "messages" in body:
        rendering = {k: body[k] for k in RENDERING_FIELDS if k in body}
        ids = (await state.off_loop(parse_chat, {**rendering, "max_tokens": 1}, limits, tokenizer)).prompts[0]
    elif isinstance(body.get("prompt"), str):
        ids = await state.off_loop(tokenizer.encode, body["prompt"], body.get("add_special_tokens", True) is True)
    else:
        raise APIError("send 'prompt' (a string) or 'messages'", param="prompt")
    strs = tokenizer.hf.convert_ids_to_tokens(ids) if body.get("return_token_strs") is True else None
    return TokenizeResponse(count=len(ids), max_model_len=limits.max_model_len, tokens=ids, token_strs=strs)


@tokenize.post("/detokenize")
async def detokenize():
    state, body = api_state(), await json_body()
    tokenizer = state.text_tokenizer("/detokenize")
    check_model(body.get("model"), state.limits)
    ids = body.get("tokens")
    vocab_size = state.limits.vocab_size
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            and 0 <= t < vocab_size for t in ids):
        raise APIError(f"'tokens' must be a list of token ids in [0, {vocab_size})", param="tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(ids))
