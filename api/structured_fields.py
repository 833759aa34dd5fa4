"""The fields that constrain decoding to a grammar, as types: OpenAI's `response_format`, vLLM's
`guided_*` fields and `structured_outputs` (its newer form of them). Which one applies, and that
only one does, is the request's `constraint()`."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict

from api.fields import OBJECT, checked

# vLLM's `structured_outputs` keys -> the guided_* field each stands for, and the grammar kind of each
STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                      "grammar": "guided_grammar"}
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
          "grammar": "grammar", "json_schema": "json_schema"}  # (the last two: llama.cpp's fields)


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""
    model_config = ConfigDict(frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None  # {"name", "schema", "strict", ...} for "json_schema"


def _response_format(name: str, fmt) -> ResponseFormat:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise ValueError("'response_format.type' must be 'text', 'json_object' or 'json_schema'")
    spec = fmt.get("json_schema") if kind == "json_schema" else None
    if kind == "json_schema" and not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):
        raise ValueError("'response_format.json_schema' needs a 'schema' object")
    if kind == "json_schema" and not isinstance(spec.get("name"), str):  # (required by OpenAI's API and vLLM's)
        raise ValueError("'response_format.json_schema' needs a 'name' string")
    return ResponseFormat(type=kind, json_schema=spec)


def guided_spec(name: str, value) -> str | tuple[str, ...]:
    """A guided_* field (or its `structured_outputs` key) as its constraint's spec."""
    if name in ("guided_json", "json_schema") and isinstance(value, dict):
        return json.dumps(value)
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise ValueError("'guided_choice' must be a non-empty list of strings")
        return tuple(value)
    if not isinstance(value, str):
        raise ValueError(f"'{name}' must be a string")
    return value


def _structured_outputs(name: str, value) -> dict:
    if not isinstance(value, dict):
        raise ValueError("'structured_outputs' must be an object")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - {*STRUCTURED_OUTPUTS, "json_object"})
    if unknown:
        raise ValueError(f"'structured_outputs.{unknown[0]}' is not supported by this server; give one of "
                         f"{', '.join([*STRUCTURED_OUTPUTS, 'json_object'])}")
    return given


def guided(name: str, schema: dict):
    return checked(str | tuple[str, ...], guided_spec, schema, name)


ResponseFormatField = checked(ResponseFormat, _response_format, OBJECT, "response_format",
                              '{"type": "text" | "json_object" | "json_schema", "json_schema": ...}')
StructuredOutputsField = checked(dict, _structured_outputs, OBJECT, "structured_outputs",
                                 "vLLM's: one of json, regex, choice, grammar, json_object")
