"""The API's errors: OpenAI's body `{"error": {message, type, param, code}}` with an HTTP status."""

from __future__ import annotations

from api.response_models import ErrorDetail, ErrorResponse


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code
        self.headers = headers or {}  # e.g. a 503's Retry-After

    def body(self) -> dict:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                               code=self.code)).dump()
