"""OpenAI's routes of stored responses (`api/response_store.py`): GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items, and POST /v1/responses/{id}/cancel (of a
background response, `api/background_responses.py`)."""

from __future__ import annotations

from quart import Blueprint, Response, request

from api.errors import APIError
from api.state import api_state

stored = Blueprint("stored_responses", __name__)


@stored.get("/v1/responses/<response_id>")
async def retrieve_response(response_id: str):
    """A stored response (OpenAI's), as it stands; with `stream=true`, a background response's events
    after sequence number `starting_after` (default: all of them), then the rest as they come."""
    entry = api_state().responses.get(response_id)
    if request.args.get("stream", "false").lower() in ("false", "0"):
        return entry.response.dump()
    if entry.run is None:
        raise APIError("'stream' is for background responses: this one was not created with background: true",
                       param="stream")
    try:
        starting_after = int(request.args.get("starting_after", -1))
    except ValueError:
        starting_after = -2
    if starting_after < -1:
        raise APIError("'starting_after' must be an event's sequence number (an integer from 0), or -1 for all",
                       param="starting_after")
    return Response(entry.run.follow(starting_after), content_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"})


@stored.post("/v1/responses/<response_id>/cancel")
async def cancel_response(response_id: str):
    """Stop a background response (OpenAI's): it is then "cancelled"; one already finished is
    returned as it is. A response not created in the background is a 400."""
    entry = api_state().responses.get(response_id)
    if entry.run is None:
        raise APIError("Cannot cancel a synchronous response: only responses created with background: true can "
                       "be cancelled", param="response_id")
    await entry.run.cancel()
    return entry.response.dump()


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
    entry = api_state().responses.get(response_id)
    if entry.run is not None:  # (a background response still running stops)
        await entry.run.cancel()
    api_state().responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
