"""Chat messages as templates take them (OpenAI's content parts joined, deprecated roles renamed),
the options a template is rendered with, and the time limit on rendering one."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator

_DEPRECATED_ROLES = {"developer": "system", "function": "tool"}


# how a message's content reaches the template (vLLM's --chat-template-content-format): as text, as
# OpenAI's list of parts, or whichever the template reads ("auto", `Tokenizer.content_format`)
CONTENT_FORMATS = ("auto", "string", "openai")


def check_chat_template(template: str) -> None:
    """A ValueError where a chat template does not compile (its Jinja syntax), said when it is given
    rather than at every request; compiled as transformers compiles it for `apply_chat_template`."""
    from jinja2 import TemplateSyntaxError
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # (a transformers without it: the error shows at the first chat request)
        return
    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not compile: {e.message} (line {e.lineno})") from None


def loops_over_content(template: str) -> bool:
    """Whether a chat template has a `for` loop over a message's content (`m.content`, `m['content']`,
    through filters, tests, slices or an `or` default), as vLLM's "auto" content format looks for."""
    from jinja2 import Environment, TemplateSyntaxError, nodes

    def is_content(node) -> bool:
        if isinstance(node, (nodes.Filter, nodes.Test)) or (isinstance(node, nodes.Getitem)
                                                            and isinstance(node.arg, nodes.Slice)):
            return node.node is not None and is_content(node.node)
        if isinstance(node, nodes.Or):
            return is_content(node.left)
        return (isinstance(node, nodes.Getattr) and node.attr == "content") or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content")

    try:
        tree = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError:
        return False
    return any(is_content(loop.iter) for loop in tree.find_all(nodes.For))


# Content parts that are text, as vLLM reads them -> the key holding the text: OpenAI's "text",
# the Responses API's "input_text" and "output_text", an assistant's "refusal".
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _text_parts(message: dict, where: str) -> list[str] | None:
    """The texts of a message's content: [the string], its text parts, or None for no content."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return None if content is None else [content]
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    texts = [part.get(TEXT_PARTS.get(part.get("type"))) if isinstance(part, dict) else None for part in content]
    if not all(isinstance(text, str) for text in texts):
        raise ValueError(f"{where}.content: only text parts are supported ({', '.join(TEXT_PARTS)})")
    return texts


def message_text(message: dict, where: str = "message") -> str:
    """A message's content as text: the string, or its text parts joined by newlines (as vLLM joins them)."""
    return "\n".join(_text_parts(message, where) or [])


def template_message(message: dict, where: str = "message", content_format: str = "string") -> dict:
    """An OpenAI chat message as templates expect it, as vLLM renders it: developer -> system,
    function -> tool (the deprecated roles), other roles as they are (a template's own, such as
    Llama 3's "ipython"); the content as text ("string") or as a list of text parts ("openai");
    tool-call arguments decoded from their JSON. ValueError, naming `where`, for a message that
    cannot be."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
        raise ValueError(f"{where} needs a 'role' (system, user, assistant, tool, or a role of the chat template)")
    parts = _text_parts(message, where)
    content = ([{"type": "text", "text": p} for p in parts or []] if content_format == "openai"
               else "\n".join(parts or []))
    out = {**message, "role": _DEPRECATED_ROLES.get(message["role"], message["role"]), "content": content}
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list")
        decoded = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"{where}.tool_calls entries need function.name")
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                raise ValueError(f"{where}: tool call arguments are not JSON") from None
            decoded.append({**call, "function": {**fn, "arguments": args}})
        out["tool_calls"] = decoded
    return out


CHAT_TEMPLATE_TIMEOUT_S = 10.0  # how long a conversation may take to render (--chat-template-timeout's default)


_TEMPLATE_CODE = "<template>"  # the file name of the Python code Jinja compiles a template into


@contextlib.contextmanager
def render_time_limit(seconds: float) -> Iterator[None]:
    """TimeoutError once `seconds` have passed, raised in the running template's own code: Jinja
    compiles a template to Python, so a trace function on this thread checks the clock at each of its
    lines and calls, and the template's loops (or recursive macros) really stop, leaving the thread
    free (a timeout around the call would leave it busy). A single long operation in C (arithmetic on
    huge numbers) is not interrupted; the template's next line is."""
    deadline = time.monotonic() + seconds

    def trace(frame, event, arg):
        if frame.f_code.co_filename != _TEMPLATE_CODE:
            return None  # (no line events outside templates, where a raise could leave a library's state half-done)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the chat template took longer than {seconds:g} s to render")
        return trace

    previous = sys.gettrace()  # (a debugger's or a coverage tool's, put back after)
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


# apply_chat_template's own arguments: not template variables a caller may pass
TEMPLATE_ARGUMENTS = frozenset({"tools", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template",
                                "messages", "conversation", "conversations"})


def template_options_error(add_generation_prompt: bool, continue_final_message: bool,
                           template_kwargs: dict | None) -> tuple[str, str] | None:
    """(the option at fault, why) where apply_chat_template's options do not go together; None if they do."""
    if add_generation_prompt and continue_final_message:
        return "continue_final_message", "continue_final_message needs add_generation_prompt to be false"
    reserved = TEMPLATE_ARGUMENTS & set(template_kwargs or {})
    if reserved:
        return "chat_template_kwargs", f"chat template arguments {sorted(reserved)} are set by their own options"
    return None
