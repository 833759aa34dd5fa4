"""Grammar-constrained decoding: a per-row allowed-token bitmask each step, from llguidance.

A request may carry a `Constraint` (JSON schema, any JSON object, regex, a choice
among strings, or a grammar: Lark, or GBNF made Lark). Each constrained sequence gets an llguidance
matcher; before a step, the rows that sample get their allowed-token bitmask
(packed 32 tokens per int32, as llguidance writes it), which the jitted sampler
applies; after the step, each sampled token advances its matcher. When the
grammar is complete the sequence finishes with reason "stop".

Rows without a constraint cost nothing here, and the sampler skips the mask
when no row has one.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import re
import threading
import weakref

import numpy as np

from jaxserve.errors import CompilerCrash
from jaxserve.structured_output.sandbox import check_grammar

log = logging.getLogger(__name__)

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class Constraint:
    kind: str  # one of CONSTRAINT_KINDS
    value: str | tuple[str, ...] | None = None  # schema (JSON text), regex, choices, or grammar (Lark or GBNF)
    # a reasoning model's thinking comes first, free, as vLLM lets it with a reasoning parser:
    # (start tag, end tag); the start tag "" where the output starts inside the thinking
    thinking: tuple[str, str] | None = None

    def grammar(self) -> str:
        """The llguidance grammar; ValueError naming the problem if it is invalid, or too complex to
        compile (`jaxserve/structured_output/sandbox.py`)."""
        try:
            grammar, error = _compile(self)
        except TimeoutError as e:  # (not kept: it may compile in time on a less busy machine)
            raise ValueError(f"the {self.kind.replace('_', ' ')} is too complex: {e}") from e
        if error:
            raise ValueError(error)
        return grammar


@functools.lru_cache(maxsize=256)
def _compile(c: Constraint) -> tuple[str, str]:
    """(the grammar, "") or ("", why it is invalid), compiled in the grammar sandbox first: a grammar
    this process could not compile in time, or at all, never reaches llguidance here."""
    import llguidance

    what = f"invalid {c.kind.replace('_', ' ')}"
    try:
        grammar = _grammar_of(c, llguidance)
    except (ValueError, TypeError, RuntimeError) as e:  # bad JSON, or llguidance's own parse errors
        return "", f"{what}: {e}"
    if c.thinking is not None:
        grammar = _after_thinking(grammar, *c.thinking)
    try:
        error = check_grammar(grammar)
    except CompilerCrash as e:
        return "", f"the {c.kind.replace('_', ' ')} is too complex: {e}"
    return ("", f"{what}: {error}") if error else (grammar, "")


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's offline form of a constraint (`SamplingParams(structured_outputs=...)`): exactly one
    of its kinds (`json`: a dict or its JSON text)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's backend switches, which describe what jaxserve does anyway: JSON without free
    # whitespace (`_compact`), objects closed to keys they do not list (`closed`), one backend
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None  # vLLM's; not supported (None only)
    structural_tag: str | None = None  # vLLM's; not supported (None only)

    def __post_init__(self):  # (as vLLM's: more than one kind is an error as soon as it is made)
        given = self._given()
        if len(given) > 1:
            raise ValueError(f"structured_outputs takes one kind of constraint, got {given}")

    def _given(self) -> list[str]:
        return [name for name in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(self, name) not in (None, False)]

    def constraint(self) -> Constraint:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"structured_outputs.{name} is not supported")
        given = self._given()
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar or json_object, "
                             f"got {given or 'none'}")
        if self.json is not None:
            return Constraint("json_schema", self.json if isinstance(self.json, str) else json.dumps(self.json))
        if self.choice is not None:
            return Constraint("choice", tuple(self.choice))
        if self.json_object:
            return Constraint("json_object")
        return Constraint("regex", self.regex) if self.regex is not None else Constraint("grammar", self.grammar)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


def _compact(schema: dict) -> str:
    """JSON text of the schema, asking llguidance for compact output (no free whitespace, which
    a weak model could spend its whole budget on) unless the schema says otherwise."""
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return json.dumps({"x-guidance": {"whitespace_flexible": False}, **closed(schema)})


# Where a JSON schema holds schemas: one, a list of them, a map of names to them.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema, close: bool = True):
    """The schema with `"additionalProperties": false` on every object schema that lists its
    `properties` and says nothing of others: the keys generated are the schema's own, as with
    vLLM's default grammar backend (xgrammar) and OpenAI's strict mode (llguidance alone would
    allow any other key). The members of an `allOf` stay open, each to the others' keys."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(s, close=False) for s in out["allOf"]]
    if close and "properties" in out and "allOf" not in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


# Perl classes as ASCII sets, as vLLM's default grammar backend (xgrammar) and JSON schema's
# patterns read them; llguidance's regexes read them as Unicode classes (\d matching "٣").
_ASCII_CLASSES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r\\f\\v"}


def ascii_classes(regex: str) -> str:
    r"""The regex with \d, \w, \s (and \D, \W, \S outside brackets) as the ASCII sets they stand
    for; nested brackets ([a[b]], [[:digit:]]) are followed, escaped characters kept."""
    out, i, depth = [], 0, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            e = regex[i + 1]
            if e in _ASCII_CLASSES:
                out.append(_ASCII_CLASSES[e] if depth else f"[{_ASCII_CLASSES[e]}]")
            elif e.lower() in _ASCII_CLASSES and not depth:
                out.append(f"[^{_ASCII_CLASSES[e.lower()]}]")
            else:
                out.append(regex[i:i + 2])
            i += 2
            continue
        out.append(c)
        i += 1
        if c == "[":
            depth += 1
            for opening in ("^", "]"):  # a negation; then a "]" that is a member ("[]a]", "[^]a]"), not the end
                if regex.startswith(opening, i):
                    out.append(opening)
                    i += 1
        elif c == "]" and depth:
            depth -= 1
    return "".join(out)


def _grammar_of(c: Constraint, llguidance) -> str:
    if c.kind == "json_schema":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_compact(json.loads(c.value)))
    elif c.kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_compact({"type": "object"}))
    elif c.kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(ascii_classes(c.value))
    elif c.kind == "choice":
        grammar = llguidance.grammar_from("choice", list(c.value))
    elif c.kind == "grammar":
        grammar = llguidance.grammar_from("grammar", c.value)  # Lark, or GBNF (llama.cpp's, xgrammar's) made Lark
    else:
        raise ValueError(f"unknown constraint kind {c.kind!r}; expected one of {CONSTRAINT_KINDS}")
    return grammar


def _after_thinking(grammar: str, start: str, end: str) -> str:
    """`grammar` after a free thinking part: `start` (or nothing, "") up to the first `end`, which the
    output must write where `start` is "" and may leave out (thinking and all) otherwise."""
    try:
        inner = json.loads(grammar)  # llguidance's top-level grammar: {"grammars": [...]}
    except ValueError:  # Lark text
        inner = {"grammars": [{"lark_grammar": grammar}]}
    first, *rest = inner["grammars"]

    def lark_regex(tag: str) -> str:
        return re.escape(tag).replace("/", "\\/")

    head, tail = lark_regex(start), lark_regex(end)
    name = first.get("name") or "answer"  # (a name the other grammars may refer to stays)
    # the thinking ends at its first end tag (and the whitespace after it, which reasoning models
    # write there): any text ending so, but with nothing other than whitespace after such a tag
    lark = (f"start: THINK answer{'' if not start else ' | answer'}\nanswer: @{name}\n"
            f"THINK: /{head}(?s:.)*{tail}\\s*/ & ~/{head}(?s:.)*{tail}(?s:.)*\\S(?s:.)*/\n")
    return json.dumps({"grammars": [{"lark_grammar": lark}, {**first, "name": name}, *rest]})


def mask_width(vocab_size: int) -> int:
    """int32 words per row of a packed token bitmask."""
    return (vocab_size + 31) // 32


class CompiledGrammars:
    """Compiled grammars kept by constraint, for one tokenizer: shared by the engines of one process
    (data-parallel replicas), so a grammar the API checked is compiled once for all of them."""

    COMPILED = 32  # compiled grammars kept: each sequence's matcher is a copy of one (sharing its lexer)

    def __init__(self, hf_tokenizer, vocab_size: int):
        import llguidance.hf

        self.vocab_size = vocab_size
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        except Exception as e:  # llguidance refuses some tokenizers (slow ones, vocab mismatches)
            raise ValueError(f"structured output is not available for this tokenizer: {e}") from e
        self._compiled: collections.OrderedDict[Constraint, object] = collections.OrderedDict()
        self._lock = threading.Lock()  # (compiled from the API's thread, copied in the engines')

    def compiled(self, constraint: Constraint):
        """The constraint's matcher at its start, its first mask computed (which builds its lexer);
        ValueError for a grammar that does not compile, or cannot give a first mask."""
        import llguidance
        import llguidance.numpy

        with self._lock:
            matcher = self._compiled.get(constraint)
            if matcher is not None:
                self._compiled.move_to_end(constraint)
                return matcher
        matcher = llguidance.LLMatcher(self.tokenizer, constraint.grammar(),
                                       limits=llguidance.LLParserLimits(verbose_errors=False))
        if not matcher.is_error():
            llguidance.numpy.fill_next_token_bitmask(matcher, np.zeros((1, mask_width(self.vocab_size)), np.int32), 0)
        if matcher.is_error():
            raise ValueError(f"invalid {constraint.kind.replace('_', ' ')}: {matcher.get_error()}")
        with self._lock:
            self._compiled[constraint] = matcher
            if len(self._compiled) > self.COMPILED:
                self._compiled.popitem(last=False)
        return matcher


_shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # hf tokenizer -> {vocab size: CompiledGrammars}
_shared_lock = threading.Lock()


def compiled_grammars(hf_tokenizer, vocab_size: int) -> CompiledGrammars:
    """The process's CompiledGrammars of this tokenizer (object) and vocabulary size."""
    with _shared_lock:
        by_vocab = _shared.setdefault(hf_tokenizer, {})
        if vocab_size not in by_vocab:
            by_vocab[vocab_size] = CompiledGrammars(hf_tokenizer, vocab_size)
        return by_vocab[vocab_size]


class GrammarMatchers:
    """llguidance matchers of the constrained sequences, keyed by sequence id (one engine's), copied
    from the process's compiled grammars (`compiled_grammars`)."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        self.grammars = compiled_grammars(hf_tokenizer, vocab_size)
        self._matchers: dict[int, object] = {}

    def compiled(self, constraint: Constraint):
        """`CompiledGrammars.compiled`."""
        return self.grammars.compiled(constraint)

    def _matcher(self, seq_id: int, constraint: Constraint):
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            matcher = self._matchers[seq_id] = self.compiled(constraint).deep_copy()
        return matcher

    def fill(self, seq_id: int, constraint: Constraint, row: np.ndarray) -> None:
        """Write the sequence's allowed next tokens into `row` (i32[mask_width])."""
        import llguidance.numpy

        matcher = self._matcher(seq_id, constraint)
        llguidance.numpy.fill_next_token_bitmask(matcher, row[None, :], 0)

    def accept(self, seq_id: int, token: int) -> str | None:
        """Advance the matcher; -> "done" when the grammar is complete, "error" when it cannot go on
        (llguidance's reason is logged), None otherwise."""
        matcher = self._matchers[seq_id]
        matcher.consume_token(token)
        if matcher.is_error():
            log.warning("grammar matcher of sequence %d failed: %s", seq_id, matcher.get_error())
            return "error"
        return "done" if matcher.is_stopped() else None

    def forget(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
