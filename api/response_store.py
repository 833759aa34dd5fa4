"""Stored responses of the Responses API (OpenAI's `store`, true by default; vLLM's under
VLLM_ENABLE_RESPONSES_API_STORE), which its routes read (`api/stored_responses.py`) and a request's
`previous_response_id` continues: that response's input items (those of the responses before it
included) and its output items come before the new input. Kept in memory: the `capacity` most
recently used (0: none, and every response says `store: false`)."""

from __future__ import annotations

import collections
import dataclasses

from api.background_responses import UNFINISHED, BackgroundRun
from api.errors import APIError
from api.response_objects import ResponseObject
from api.sse import new_id

_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    items: list  # the conversation's input items up to this response's own (no instructions: never carried over)
    listed: list  # the response's own input items as GET .../input_items lists them, oldest first
    run: BackgroundRun | None = None  # a background response's task (`response` is then the one it grows)


def listed_item(item: dict) -> dict:
    """An input item as OpenAI lists it: with an id (given, else a new one) and a status; a message's
    text content as one text part."""
    kind = item.get("type", "message")
    out = {**item, "type": kind, "id": item.get("id") or new_id(_ID_PREFIXES.get(kind, "item"), "_"),
           "status": item.get("status", "completed")}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": item["content"]}]
    return out


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def put(self, response: ResponseObject, items: list, own: int, run: BackgroundRun | None = None) -> None:
        """Keep a finished response (or, with its `run`, a background one as it grows), `items` its
        conversation's input items, the last `own` of them its own."""
        listed = [listed_item(item) for item in items[len(items) - own:]]
        kept = response if run is not None else response.model_copy(deep=True)
        self._entries[response.id] = StoredResponse(kept, items, listed, run)
        self._entries.move_to_end(response.id)
        # (the least recently used go first, but not a background response still running: it would be lost)
        for response_id in [key for key, entry in self._entries.items()
                            if key != response.id and (entry.run is None or entry.run.done)]:
            if len(self._entries) <= self.capacity:
                break
            del self._entries[response_id]

    def get(self, response_id: str) -> StoredResponse:
        """The stored response; a 404 where there is none (never stored, deleted, or the oldest dropped)."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(f"Response with id '{response_id}' not found.", status=404, param="response_id",
                           code="response_not_found")
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]

    def history(self, previous_response_id: object) -> list:
        """The input items that come before a request's own under `previous_response_id`."""
        if not isinstance(previous_response_id, str):
            raise APIError("'previous_response_id' must be a string", param="previous_response_id")
        try:
            entry = self.get(previous_response_id)
        except APIError:
            raise APIError(f"Previous response with id '{previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found") from None  # (a 400)
        if entry.response.status in UNFINISHED:
            raise APIError(f"Previous response with id '{previous_response_id}' is still {entry.response.status}: "
                           "continue it once it has finished", param="previous_response_id")
        return [*entry.items, *(item.dump() for item in entry.response.output)]
