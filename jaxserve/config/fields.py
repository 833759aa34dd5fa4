"""Settings declared once: a config dataclass field carries its default, its help and the other
names vLLM gives it; the command line's flags and the offline `LLM`'s keyword arguments are
generated from the fields (`add_arguments`, `options_to_fields`), and so is `docs/cli.md`
(`markdown_reference`). Nothing here knows which settings exist."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable


def setting(default, help: str, *, flags: tuple[str, ...] = (), aliases: tuple[str, ...] = (),
            choices: tuple | None = None, type: Callable | None = None, negatable: bool = False,
            cli: bool = True, compiled: bool = False, nargs: str | None = None):
    """A config field: `default`, `help` (for --help and docs/cli.md); `flags`: more option strings
    than --field-name (vLLM's other spellings, e.g. "--block-size", "-tp"); `aliases`: keyword
    names `LLM` takes for it too (e.g. "block_size"); `choices`, `type`, `nargs`: as argparse's
    (`type` defaults to the default's type); a boolean is a switch, with its --no- form where
    `negatable`; `cli=False`: no flag (an internal setting); `compiled`: the compiled step depends
    on it (the executable cache's key, see `compiled_fields`)."""
    meta = dict(help=help, flags=flags, aliases=aliases, choices=choices, type=type, negatable=negatable,
                cli=cli, compiled=compiled, nargs=nargs)
    return dataclasses.field(default=default, metadata={"setting": meta})


def _meta(field: dataclasses.Field) -> dict | None:
    return field.metadata.get("setting")


def fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if _meta(f) is not None]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(group, cls) -> None:
    """One argparse flag per `setting` field of `cls` (those with `cli`), dest = the field's name."""
    for field in fields(cls):
        meta = _meta(field)
        if not meta["cli"]:
            continue
        names = [flag_name(field.name), *meta["flags"]]
        kwargs = dict(dest=field.name, default=field.default, help=meta["help"])
        if isinstance(field.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction if meta["negatable"] else "store_true"
        else:
            kwargs["type"] = meta["type"] or (type(field.default) if field.default is not None else str)
            if meta["choices"] is not None:
                kwargs["choices"] = list(meta["choices"])
            if meta["nargs"] is not None:
                kwargs["nargs"] = meta["nargs"]
        group.add_argument(*names, **kwargs)


def from_namespace(cls, args: argparse.Namespace, **more):
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if _meta(f)["cli"]}, **more)


def options_to_fields(cls, options: dict) -> tuple[dict, dict]:
    """Keyword options given by their names or `aliases` -> ({field: value}, {other name: value}).
    A field given under two names must be given one value (ValueError)."""
    alias_of = {alias: f.name for f in fields(cls) for alias in _meta(f)["aliases"]}
    names = {f.name for f in fields(cls)}
    out, rest, given_as = {}, {}, {}
    for name, value in options.items():
        target = alias_of.get(name, name if name in names else None)
        if target is None:
            rest[name] = value
        elif value is None:
            continue  # None is the option left out (vLLM's scripts pass None for defaults)
        elif target in out and out[target] != value:
            raise ValueError(f"{given_as[target]}={out[target]} and {name}={value} are one setting: give one of them")
        else:
            out[target], given_as[target] = value, name
    return out, rest


def compiled_fields(config) -> dict:
    return {f.name: getattr(config, f.name) for f in fields(type(config)) if _meta(f)["compiled"]}


def json_value(what: str, ok: Callable[[object], bool]) -> Callable[[str], object]:
    """An argparse type: the flag's value read as JSON, which `ok` must accept."""
    def parse(value: str):
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not ok(parsed):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
        return parsed
    return parse


json_object = json_value("a JSON object", lambda v: isinstance(v, dict))
json_strings = json_value("""a JSON list of strings such as '["*"]'""",
                          lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v))


def optional_text(value: str) -> str | None:
    """An optional string as vLLM reads it from a flag: "None" and "none" are None."""
    return None if value in ("None", "none") else value


def json_or_text(value: str):
    """JSON where the flag's value is JSON, else the text (vLLM's dict-or-name flags)."""
    try:
        return json.loads(value)
    except ValueError:
        return optional_text(value)


def markdown_reference(parser: argparse.ArgumentParser, title: str, intro: str) -> str:
    """The flags of `parser`, group by group, as a Markdown page (docs/cli.md)."""
    lines = [f"# {title}", "", intro, ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        lines += [f"## {group.title}", "", "| flag | default | what it does |", "| --- | --- | --- |"]
        for action in actions:
            names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
            if action.choices is not None:
                names += " {" + ", ".join(map(str, action.choices)) + "}"
            default = "" if action.default in (None, argparse.SUPPRESS) else f"`{action.default}`"
            text = (action.help or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {names} | {default} | {text} |")
        lines.append("")
    return "\n".join(lines)


def config_object(value: dict | str | None, name: str, known: tuple[str, ...] | list[str]) -> dict | None:
    """A JSON configuration flag's object (given as one, or as its text), None for none; ValueError
    where it is not an object or names a field not in `known`."""
    if value is None:
        return None
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{name}: {', '.join(map(repr, unknown))} not supported (supported: {', '.join(known)})")
    return value
