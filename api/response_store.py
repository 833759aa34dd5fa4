"""Stored responses of the Responses API (OpenAI's `store`, true by default; vLLM's under
VLLM_ENABLE_RESPONSES_API_STORE): GET and DELETE /v1/responses/{id}, and `previous_response_id`,
which continues a stored response's conversation: its input items (those of the responses before
it included) and its output items come before the new input. Kept in memory: the `capacity` most
recently used (0: none, and every response says `store: false`)."""

from __future__ import annotations

import collections
import dataclasses

from api.errors import APIError
from api.response_objects import ResponseObject


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    items: list  # the conversation's input items up to this response's own (no instructions: never carried over)


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def put(self, response: ResponseObject, items: list) -> None:
        self._entries[response.id] = StoredResponse(response.model_copy(deep=True), items)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

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
        return [*entry.items, *(item.dump() for item in entry.response.output)]
