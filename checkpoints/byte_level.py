"""GPT-2's byte-level table: the printable character that byte-level BPE vocabularies write for each byte."""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what byte-level BPE vocabularies hold)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
