"""The model's Hugging Face tokenizer: prompts to ids, and generated ids to text deltas.

Generated text is always produced incrementally (`IncrementalDetokenizer`), in
streaming and non-streaming responses alike, so the two agree by construction:
the text of a completion is the concatenation of its deltas.

Rendering a chat template is bounded in time (`render_time_limit`): a template is code, and a
request may bring its own (--trust-request-chat-template).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from checkpoints.byte_level import bytes_to_unicode

REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


_DEPRECATED_ROLES = {"developer": "system", "function": "tool"}
# how a message's content reaches the template (vLLM's --chat-template-content-format): as text, as
# OpenAI's list of parts, or whichever the template reads ("auto", `Tokenizer.content_format`)
CONTENT_FORMATS = ("auto", "string", "openai")


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


def _not_about_torch(record: logging.LogRecord) -> bool:
    """transformers says at import that PyTorch is missing, which jaxserve never needs (tokenizers
    need none): a newcomer reads it as an error. Its other warnings pass."""
    return not record.getMessage().startswith("PyTorch was not found.")


# (on the "transformers" logger itself, where the message is logged: importing transformers sets
# that logger's level and handler, not its filters)
logging.getLogger("transformers").addFilter(_not_about_torch)


# the files a Hugging Face tokenizer is read from (one is enough)
TOKENIZER_FILES = ("tokenizer*", "vocab*", "*.tiktoken", "spiece.model")


def check_tokenizer_files(directory: str | Path) -> None:
    """FileNotFoundError, saying the fix, where `directory` holds none of TOKENIZER_FILES: a model
    trained on its own vocabulary may come without them, and is then served on token ids alone."""
    if not any(next(Path(directory).glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{directory} has no tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model, ...): "
            "serve the model on token ids alone with --skip-tokenizer-init (LLM(..., skip_tokenizer_init=True)), "
            "or read the tokenizer from another directory with --tokenizer")


class Tokenizer:
    def __init__(self, model_dir: str | Path, chat_template: str | None = None):
        from transformers import AutoTokenizer

        check_tokenizer_files(model_dir)
        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        if chat_template is not None:
            self.hf.chat_template = chat_template
        self._token_bytes: dict[int, bytes] = {}
        self._added: dict[int, str] | None = None  # added token id -> its text (`added_content`)
        self._byte_decoder = _byte_decoder(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt, with the special tokens the model expects (e.g. BOS) unless told not to."""
        return list(self.hf(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ids, special tokens (EOS, ...) left out unless told otherwise."""
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def added_content(self, token_id: int) -> str | None:
        """An added token's own text (special tokens, chat markers, ...); None for a vocabulary piece."""
        if self._added is None:
            self._added = {i: token.content for i, token in self.hf.added_tokens_decoder.items()}
        return self._added.get(token_id)

    def content_format(self, chat_template: str | None = None, requested: str = "auto") -> str:
        """"string" or "openai" (see CONTENT_FORMATS): `requested`, or for "auto" (vLLM's default)
        "openai" where the template (`chat_template` or the model's) loops over a message's content."""
        if requested not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                             f"got {requested!r}")
        if requested != "auto":
            return requested
        template = chat_template or self.hf.chat_template or ""
        source = "\n".join(template.values()) if isinstance(template, dict) else template
        return "openai" if loops_over_content(source) else "string"

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, *,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            chat_template: str | None = None, template_kwargs: dict | None = None,
                            timeout: float = CHAT_TEMPLATE_TIMEOUT_S) -> str:
        """The conversation (and the tools offered, if any) as prompt text, ending with the assistant's
        turn opened (`add_generation_prompt`) or with the last message left open for the model to go
        on (`continue_final_message`). `chat_template` replaces the model's for this call;
        `template_kwargs` are more variables for the template (e.g. `enable_thinking`). TimeoutError
        where rendering takes longer than `timeout` seconds (`render_time_limit`)."""
        if not (chat_template or self.hf.chat_template):  # (the model's may be several, chosen by HF: tools or not)
            raise ValueError("this model's tokenizer has no chat template; pass one with --chat-template")
        error = template_options_error(add_generation_prompt, continue_final_message, template_kwargs)
        if error:
            raise ValueError(error[1])
        with render_time_limit(timeout):
            return self.hf.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=chat_template,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message,
                                               **(template_kwargs or {}))

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (a SentencePiece "▁" is a space; byte-fallback and byte-level
        pieces are their raw bytes), for logprobs."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            piece = self.hf.convert_ids_to_tokens(token_id)
            added = self.hf.added_tokens_decoder.get(token_id)
            fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece or "")
            if piece is None:
                cached = b""
            elif added is not None:
                cached = added.content.encode()
            elif fallback:
                cached = bytes([int(fallback[1], 16)])
            elif self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
                cached = bytes(self._byte_decoder[c] for c in piece)
            else:
                cached = piece.replace("\u2581", " ").encode()
            self._token_bytes[token_id] = cached
        return cached

    def decode_token(self, token_id: int) -> str:
        """One token's own text (U+FFFD where it holds part of a character)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _byte_decoder(hf) -> dict[str, int] | None:
    """Stand-in character -> byte, for byte-level BPE tokenizers; None for the others."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or '"ByteLevel"' not in json.dumps(json.loads(backend.to_str()).get("decoder")):
        return None
    return {ch: b for b, ch in bytes_to_unicode().items()}


class IncrementalDetokenizer:
    """Text deltas for a growing list of generated ids.

    Decodes a short window: `ids[prefix:read]` was already emitted, `ids[prefix:]`
    is decoded again with the new tokens, and the difference is the delta. The
    window starts on the prompt's last tokens, so a SentencePiece leading space
    ("▁word") is kept and a byte-level token is decoded in context. A delta that
    ends in U+FFFD (a multi-byte character split across tokens) is held back
    until the character is complete; `flush` releases what is left at the end.
    Without `spaces_between_special_tokens` (and with special tokens kept), an added
    token right after another is its own text, whatever space the tokenizer's decode
    would put between them (vLLM's rule).
    """

    PROMPT_CONTEXT = 5  # prompt tokens the window starts on

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.joins_added_tokens = not (skip_special_tokens or spaces_between_special_tokens)
        self.after_added = False  # (joins_added_tokens) the last token was an added one
        self.ids = list(prompt_ids[-self.PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # every delta emitted so far

    def _pending(self) -> str:
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; -> the new text that is certain (may be "")."""
        if self.joins_added_tokens:
            return "".join(self._push_joined(token) for token in token_ids)
        return self._push(token_ids)

    def _push_joined(self, token: int) -> str:
        added = self.tokenizer.added_content(token)
        after_added, self.after_added = self.after_added, added is not None
        if added is None or not after_added:
            return self._push([token])
        self.ids.append(token)  # (nothing is held back after an added token)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += added
        return added

    def _push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        delta = self._pending()
        if not delta or delta.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is held back (an incomplete character decodes as U+FFFD)."""
        delta = self._pending()
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


# Stop strings in released text: where one ends, and how much of a text's tail could still start one.
def find_stop(text: str, stops: list[str], checked: int) -> tuple[int, str] | None:
    """Earliest (index, stop string) occurring in `text` and ending after text[:checked]."""
    hits = [(i, s) for s in stops if (i := text.find(s, max(0, checked - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def undecided_tail(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                if text[len(text) - k:] == s[:k]), default=0)
