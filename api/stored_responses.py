"""OpenAI's routes of stored responses (`api/response_store.py`): GET and DELETE
/v1/responses/{id}, and GET /v1/responses/{id}/input_items."""

from __future__ import annotations

from quart import Blueprint, request

from api.errors import APIError
from api.state import api_state

stored = Blueprint("stored_responses", __name__)


@stored.get("/v1/responses/<response_id>")
async def retrieve_response(response_id: str):
    """A stored response (OpenAI's); streaming one again is for background responses, which are not run."""
    if request.args.get("stream", "false").lower() not in ("false", "0"):
        raise APIError("'stream' is for background responses, which are not available", param="stream")
    return api_state().responses.get(response_id).response.dump()


@stored.get("/v1/responses/<response_id>/input_items")
async def list_input_items(response_id: str):
    """A stored response's own input items (OpenAI's list: `order` desc by default, `limit` 1-100, `after` an
    item's id)."""
    items = api_state().responses.get(response_id).listed
    order, after = request.args.get("order", "desc"), request.args.get("after")
    if order not in ("asc", "desc"):
        raise APIError("'order' must be 'asc' or 'desc'", param="order")
    try:
        limit = int(request.args.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise APIError("'limit' must be an integer from 1 to 100", param="limit")
    items = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(f"'after': no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@stored.delete("/v1/responses/<response_id>")
async def delete_response(response_id: str):
    api_state().responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
