"""How the offline tools print a text report: lines of at most :data:`WIDTH` columns.

A line longer than that is wrapped at its spaces, continuation lines indented two
columns past the line's own indent (or under a value column the caller names, where the
words fit there). A word is never broken (a chunk name, a namespace or a JSON string
stays whole and copyable), so only a single word longer than the width makes a line
wider than it. :func:`say_parts` wraps a line of fields only between fields, so a value
with spaces in it (``kv torch.bfloat16 NHD``) is never split either.

What a report prints may come from storage other programs write (a manifest's model
name, salt or layer names on a shared bucket), so a character that is not printable —
a control such as ESC or an 8-bit CSI, a format character such as a right-to-left
override, a line separator — is written as its Python escape (``\x1b``, ``\u202e``):
the report shows what the value holds and never drives the terminal.
"""

from __future__ import annotations

import textwrap
from typing import TextIO

#: Text reports wrap at this many columns.
WIDTH = 80
#: Seconds in a day: the unit of the reports' ages and of ``gc``'s day counts.
DAY_S = 86400.0


def _wrap(line: str, indent: int) -> list[str]:
    return textwrap.wrap(line, WIDTH, subsequent_indent=" " * indent, break_on_hyphens=False,
                         break_long_words=False) or [""]


def visible(text: str) -> str:
    """``text`` with every character that is not printable written as its escape."""
    if text.isprintable():
        return text
    return "".join(
        char if char.isprintable() else char.encode("unicode_escape").decode("ascii")
        for char in text
    )


def say(out: TextIO, line: str, *, hang: int | None = None) -> None:
    """Print ``line`` wrapped to :data:`WIDTH` columns, its characters that are not
    printable escaped (:func:`visible`). Continuation lines start at column ``hang`` when
    given and every piece fits there, else two columns past the line's indent."""
    line = visible(line)
    lines = None
    if hang is not None:
        lines = _wrap(line, hang)
        if max(map(len, lines)) > WIDTH:
            lines = None
    if lines is None:
        lines = _wrap(line, len(line) - len(line.lstrip(" ")) + 2)
    print("\n".join(lines), file=out)


def say_parts(out: TextIO, parts: list[str], *, indent: int = 0,
              separator: str = ", ") -> None:
    """Print ``parts`` (fields such as ``engine vllm``) joined by ``separator`` (its
    punctuation, then one space) at ``indent``, wrapped only between parts: a line breaks
    after a separator and a field is never split across lines (one longer than
    :data:`WIDTH` stands alone). Characters that are not printable are escaped
    (:func:`visible`)."""
    shown = [visible(part) for part in parts]
    lines: list[str] = []
    current = " " * indent
    for index, part in enumerate(shown):
        piece = part + (separator.rstrip() if index < len(shown) - 1 else "")
        if current.strip() and len(current) + 1 + len(piece) > WIDTH:
            lines.append(current)
            current = " " * (indent + 2)
        current += (" " if current.strip() else "") + piece
    lines.append(current)
    print("\n".join(lines), file=out)


def age(mtime: float, now: float) -> str:
    """How long before ``now`` ``mtime`` was (seconds since the epoch both), in the
    largest unit it reaches: ``2.5 d``, ``3.0 h``, ``12.0 min``, ``40 s`` (0 for a time
    in the future)."""
    seconds = max(0.0, now - mtime)
    for unit, size in (("d", DAY_S), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"
