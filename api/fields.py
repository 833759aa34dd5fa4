"""The field types of the request models: each checks its JSON type and bounds once and says what is
wrong in OpenAI's words, naming the field (`validated`). Null means absent, a whole-number float counts
as an integer, and unknown fields are kept as they came (as OpenAI and vLLM do).

A rule in a field's metadata gives its message: `Typed` (one JSON type), `Bounds` (a number in a
range), or `Says` (a check of its own that converts the value and raises a ValueError with the
message, e.g. `stop` as a list of strings).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Annotated, get_args

from pydantic import BaseModel, BeforeValidator, Field, JsonValue, TypeAdapter, ValidationError, WithJsonSchema

from api.errors import APIError

MAX_TOKENS = 2**31  # OpenAI's bound on max_tokens and the other token counts


@dataclasses.dataclass(frozen=True)
class Typed:
    """A field of one JSON type: the message of a value of another."""
    what: str  # "a boolean", "a string", "an object"

    def message(self, name: str, error: dict) -> str:
        return f"'{name}' must be {self.what}, got {error['input']!r}"


@dataclasses.dataclass(frozen=True)
class Bounds:
    """A number field in [lo, hi] (or (lo, hi] where `lo_open`): the messages of a value of the wrong
    type and of one out of range (non-finite numbers included)."""
    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False

    def message(self, name: str, error: dict) -> str:
        value = error["input"]
        if error["type"] in ("int_type", "float_type"):
            return f"'{name}' must be {'an integer' if self.integer else 'a number'}, got {value!r}"
        return f"'{name}' must be in {'(' if self.lo_open else '['}{self.lo}, {self.hi}], got {value}"


@dataclasses.dataclass(frozen=True)
class Says:
    """A field whose check (a before-validator) raises a ValueError with the whole message."""

    def message(self, name: str, error: dict) -> str:
        return str(error["ctx"]["error"])


def whole(value):
    """A whole-number float as the integer it stands for (5.0 is 5, as vLLM's request models read it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def number(lo: float, hi: float, lo_open: bool = False):
    """An optional number in [lo, hi] (or (lo, hi]); booleans and strings are not numbers."""
    bound = Field(strict=True, gt=lo, le=hi, allow_inf_nan=False) if lo_open else \
        Field(strict=True, ge=lo, le=hi, allow_inf_nan=False)
    return Annotated[Annotated[float, bound] | None, Bounds(lo, hi, lo_open=lo_open)]


def integer(lo: int, hi: int):
    """An optional integer in [lo, hi]; a whole-number float is read as the integer."""
    return Annotated[Annotated[int, Field(strict=True, ge=lo, le=hi)] | None, BeforeValidator(whole),
                     Bounds(lo, hi, integer=True)]


def checked(field_type, check: Callable[[str, object], object], schema: dict, name: str,
            description: str | None = None, null: bool = True):
    """An optional field read by `check(name, value)` (not called for null unless `null` is False:
    then null is the check's to refuse), which returns the value as `field_type` or raises a
    ValueError with the message; `schema` in the OpenAPI document."""
    def read(value):
        return None if value is None and null else check(name, value)
    return Annotated[field_type | None, BeforeValidator(read),
                     WithJsonSchema({**schema, **({"description": description} if description else {})}), Says()]


def described(schema: dict, description: str | None = None):
    """A field read where its turn comes, after the others (`FieldCheck`, `api/tools.py`): any JSON
    here, `schema` in the OpenAPI document, or null (taken as absent, as every optional field)."""
    if {"type": "null"} not in schema.get("anyOf", []):
        schema = {"anyOf": [schema, {"type": "null"}]}
    return Annotated[JsonValue, WithJsonSchema({**schema, **({"description": description} if description else {})})]


def documented(field_type, description: str | None = None):
    """A field of the chat request that another request passes on to it, described as the chat
    request's field and checked there."""
    return described(TypeAdapter(field_type).json_schema(), description)


Bool = Annotated[Annotated[bool, Field(strict=True)] | None, Typed("a boolean")]
Str = Annotated[Annotated[str, Field(strict=True)] | None, Typed("a string")]
Object = Annotated[Annotated[dict, Field(strict=True)] | None, Typed("an object")]

STRING = {"type": "string"}
OBJECT = {"type": "object"}
STRINGS = {"type": "array", "items": STRING}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}


def _rule(metadata) -> Typed | Bounds | Says:
    return next(m for m in metadata if isinstance(m, (Typed, Bounds, Says)))


def validated(model: type[BaseModel], body: dict):
    """The body as `model` reads it (frozen); a 400 naming the first field at fault otherwise. A check
    of several fields that fails is the 400 its validator raises (an `APIError`)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        name = error["loc"][0]
        raise APIError(_rule(model.model_fields[name].metadata).message(name, error), param=name) from e


class FieldCheck:
    """The check of a `described` field, made where its turn comes (`length_penalty`: once
    `use_beam_search` is known)."""

    def __init__(self, field_type):
        self.adapter = TypeAdapter(field_type)
        self.rule = _rule(get_args(field_type)[1:])

    def __call__(self, value, name: str, default):
        """`value` as the field reads it, `default` where it is null; a 400 naming it otherwise."""
        try:
            value = self.adapter.validate_python(value)
        except ValidationError as e:
            raise APIError(self.rule.message(name, e.errors()[0]), param=name) from e
        return default if value is None else value


def token_ids(value) -> list[int] | None:
    """A list of token ids (whole-number floats read as integers); None where `value` is not one."""
    if not isinstance(value, list):
        return None
    ids = [whole(t) for t in value]
    return ids if all(isinstance(t, int) and not isinstance(t, bool) for t in ids) else None


def _strings(message: str, name: str, value) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError(message.format(name=name))
    return value


def _token_id_list(name: str, value) -> list[int]:
    ids = token_ids(value)
    if ids is None:
        raise ValueError(f"'{name}' must be a list of token ids")
    return ids


def _object(name: str, value) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"'{name}' must be an object")
    return value


def strings(name: str, description: str | None = None):
    """An optional list of strings."""
    return checked(list[str], functools.partial(_strings, "'{name}' must be a list of strings"), STRINGS, name,
                   description)


def token_id_list(name: str):
    """An optional list of integers (whether they are in the vocabulary is the engine's check)."""
    return checked(list[int], _token_id_list, TOKEN_IDS, name)


def object_of(name: str, description: str | None = None):
    """An optional JSON object, "'name' must be an object" otherwise."""
    return checked(dict, _object, OBJECT, name, description)
