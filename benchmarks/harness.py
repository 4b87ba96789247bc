"""The benchmarks' shared pieces: the machine note, the result schema, statistics, flags.

Every bench under ``benchmarks/`` keeps only its workload and its prose; what they all do
the same way lives here:

- :func:`machine_note` — the machine a run measured on, one dict shape for every bench
  (:data:`MACHINE_KEYS` always, bench-specific extras beside them), and
  :func:`machine_sentence` to print it;
- :func:`result` / :func:`write_result` — one versioned result document
  (:data:`SCHEMA_VERSION`; :func:`validate` states the shape) written as
  ``results/<stem>.json`` beside the bench's ``results/<stem>.md``; :func:`to_document`
  builds it from a bench's flat dict and its ``LAYOUT``, :func:`read_result` and
  :func:`from_document` give that dict back (to re-render, to compare with a new run);
- :func:`percentile` and :func:`spread` — one definition of a percentile (linear between
  closest ranks) and of a median with its spread;
- :func:`add_common_flags` — ``--quick``, ``--out``, ``--no-write`` and, where a bench
  has them, ``--rounds`` and ``--seed``;
- :func:`markdown_table` — the results pages' tables, and :func:`kept_section` for the
  hand-written reading below them that a rerun keeps;
- :func:`drop_page_cache` and :func:`timed_threads` — the file benches' cold reads and
  their thread-pool timing.

This module imports only the standard library so that a bench run by any interpreter
(the engine's, the GPU machine's, another project's venv) can load it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: Raised whenever a result document's shape changes; :func:`validate` accepts only this.
SCHEMA_VERSION = 1

#: Where results go unless ``--out`` says otherwise.
RESULTS = Path(__file__).resolve().parent / "results"

#: The keys of every measured machine note (:func:`machine_note`).
MACHINE_KEYS = ("date", "cpu", "cores", "load", "python", "kernel")

#: The keys of a result document, in the order they are written.
DOCUMENT_KEYS = ("schema", "bench", "machine", "parameters", "tables", "summary", "extra")

#: The keys of a :func:`spread`.
SPREAD_KEYS = ("n", "median", "min", "max", "p25", "p75")


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as ``"a, b, c"``."""
    return ", ".join(f"{value:.1f}" for value in os.getloadavg())


def utc_now() -> str:
    """The time of day in the notes' format, ``YYYY-MM-DD HH:MM UTC``."""
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"


def machine_note(**extra: object) -> dict[str, Any]:
    """The machine a run is measured on, taken now.

    Always :data:`MACHINE_KEYS` (``cores`` an int, ``load`` the load averages at the start);
    ``extra`` adds what a bench's numbers also depend on (a library's version, the server,
    the filesystem of the bench directory); an extra may not replace a common key.
    Call :func:`finish_note` at the end of the run to add ``load_end``.
    """
    clash = sorted(set(extra) & set(MACHINE_KEYS))
    if clash:
        raise ValueError(f"machine note extras may not replace {clash}")
    note: dict[str, Any] = {
        "date": utc_now(),
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 0,
        "load": load_average(),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }
    note.update(extra)
    return note


def finish_note(note: dict[str, Any]) -> dict[str, Any]:
    """``note`` with ``load_end``, the load averages now (the run's end)."""
    return {**note, "load_end": load_average()}


def filesystem_of(directory: Path) -> str:
    """The filesystem type ``directory`` lives on (``findmnt``), or ``"unknown"``."""
    import subprocess  # only the file benches ask

    found = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "--target", str(directory)],
                           capture_output=True, text=True, check=False).stdout.strip()
    return found or "unknown"


def machine_sentence(note: Mapping[str, Any]) -> str:
    """One line for a results page: any note :func:`validate` accepts, measured or not."""
    if "unknown" in note:
        return f"unknown ({note['unknown']})"
    if "original" in note:
        original = note["original"]
        if isinstance(original, Mapping):
            return "; ".join(f"{key} {value}" for key, value in original.items())
        return str(original)
    parts = [
        f"{note['date']}; CPU {note['cpu']}, {note['cores']} cores; kernel {note['kernel']}; "
        f"Python {note['python']}; load {note['load']}"
    ]
    parts += [f"{key.replace('_', ' ')} {value}" for key, value in note.items()
              if key not in MACHINE_KEYS]
    return "; ".join(parts)


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between the closest ranks.

    The same definition as numpy's default and ``statistics.quantiles(method="inclusive")``:
    ``percentile(v, 50)`` is the median, 0 the least, 100 the greatest. Raises
    ``ValueError`` on no values or ``q`` outside 0-100.
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0-100")
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def spread(values: Iterable[float]) -> dict[str, float]:
    """The median of ``values`` with their spread: :data:`SPREAD_KEYS` (quartiles by
    :func:`percentile`). Raises ``ValueError`` on no values."""
    data = list(values)
    if not data:
        raise ValueError("spread of no values")
    return {
        "n": len(data), "median": statistics.median(data), "min": min(data), "max": max(data),
        "p25": percentile(data, 25), "p75": percentile(data, 75),
    }


def add_common_flags(parser: argparse.ArgumentParser, *, quick: str = "a short smoke run",
                     rounds: int | None = None, seed: int | None = None
                     ) -> argparse.ArgumentParser:
    """Add the flags every bench takes: ``--quick`` (``quick`` says what it shrinks),
    ``--out`` (the results folder, :data:`RESULTS` by default) and ``--no-write`` (print
    only); ``--rounds`` and ``--seed`` where the bench has them (their defaults given)."""
    parser.add_argument("--quick", action="store_true", help=quick + " (writes nothing)")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="where results/<stem>.json and .md go (default %(default)s)")
    parser.add_argument("--no-write", action="store_true", help="print, write nothing")
    if rounds is not None:
        parser.add_argument("--rounds", type=int, default=rounds,
                            help="rounds per measurement (default %(default)s)")
    if seed is not None:
        parser.add_argument("--seed", type=int, default=seed,
                            help="seed of the workload's randomness (default %(default)s)")
    return parser


def bench_parser(doc: str | None, **flags: Any) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` described by the first line of ``doc`` (the bench module's
    docstring) with :func:`add_common_flags` (``flags`` go there)."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0])
    return add_common_flags(parser, **flags)


def result(bench: str, machine: Mapping[str, Any], *,
           parameters: Mapping[str, Any] | None = None,
           tables: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
           summary: Mapping[str, Any] | None = None,
           extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A result document (:func:`validate` states its shape).

    ``parameters``: what the run was asked to do (sizes, rounds, the command);
    ``tables``: the measured rows by table name, each row a flat-ish dict;
    ``summary``: headline numbers, each a number or a :func:`spread`;
    ``extra``: whatever else the bench's page needs (notes, nested sections).
    """
    return {
        "schema": SCHEMA_VERSION,
        "bench": bench,
        "machine": dict(machine),
        "parameters": dict(parameters or {}),
        "tables": {name: [dict(row) for row in rows] for name, rows in (tables or {}).items()},
        "summary": dict(summary or {}),
        "extra": dict(extra or {}),
    }


def to_document(bench: str, flat: Mapping[str, Any], *, parameters: Sequence[str] = (),
                tables: Sequence[str] = (), summary: Sequence[str] = ()) -> dict[str, Any]:
    """A result document from a bench's own flat dict: ``flat["machine"]`` is the machine
    note, the keys named in ``parameters``, ``tables`` and ``summary`` go to those
    sections, every other key to ``extra``. A named key ``flat`` lacks is left out (a
    bench's optional section); :func:`from_document` is the inverse."""
    named = {"machine", *parameters, *tables, *summary}
    return result(
        bench, flat["machine"],
        parameters={key: flat[key] for key in parameters if key in flat},
        tables={key: flat[key] for key in tables if key in flat},
        summary={key: flat[key] for key in summary if key in flat},
        extra={key: value for key, value in flat.items() if key not in named},
    )


def from_document(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The flat dict :func:`to_document` took ``doc`` from: ``machine`` and every
    section's keys at one level, for a bench's renderer. Raises ``ValueError`` where two
    sections hold the same key (the flat dict could not say which)."""
    flat: dict[str, Any] = {"machine": doc["machine"]}
    for section in ("parameters", "tables", "summary", "extra"):
        for key, value in doc[section].items():
            if key in flat:
                raise ValueError(f"{key!r} is in two sections of the {doc['bench']} result")
            flat[key] = value
    return flat


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def validate(doc: object) -> list[str]:
    """What is wrong with ``doc`` as a result document; empty when nothing is.

    The shape: a dict with exactly :data:`DOCUMENT_KEYS`; ``schema`` ==
    :data:`SCHEMA_VERSION`; ``bench`` a non-empty string; ``machine`` one of a measured
    note (:data:`MACHINE_KEYS` present, ``cores`` an int), a converted one (``original``:
    the note an older results file held, verbatim) or ``{"unknown": <why>}`` (the older
    file held none); ``parameters`` and ``extra`` dicts; ``tables`` a dict of lists of
    dicts; ``summary`` a dict whose values are numbers or :func:`spread` dicts.
    """
    if not isinstance(doc, dict):
        return [f"a result is a JSON object, not {type(doc).__name__}"]
    problems = []
    if tuple(doc) != DOCUMENT_KEYS:
        problems.append(f"keys {list(doc)}, expected {list(DOCUMENT_KEYS)}")
    if doc.get("schema") != SCHEMA_VERSION:
        problems.append(f"schema {doc.get('schema')!r}, expected {SCHEMA_VERSION}")
    if not isinstance(doc.get("bench"), str) or not doc.get("bench"):
        problems.append("bench is not a non-empty string")
    problems += _machine_problems(doc.get("machine"))
    for key in ("parameters", "extra", "tables", "summary"):
        if not isinstance(doc.get(key), dict):
            problems.append(f"{key} is not an object")
    for name, rows in (doc.get("tables") or {}).items():
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            problems.append(f"table {name!r} is not a list of objects")
    for name, value in (doc.get("summary") or {}).items():
        if _is_number(value):
            continue
        if not (isinstance(value, dict) and tuple(value) == SPREAD_KEYS
                and all(_is_number(v) for v in value.values())):
            problems.append(f"summary {name!r} is neither a number nor a spread")
    return problems


def _machine_problems(note: object) -> list[str]:
    if not isinstance(note, dict):
        return ["machine is not an object"]
    if "unknown" in note:
        ok = set(note) == {"unknown"} and isinstance(note["unknown"], str)
        return [] if ok else ["an unknown machine note holds only the reason, a string"]
    if "original" in note:
        ok = isinstance(note["original"], str | dict) and note["original"] != ""
        return [] if ok else ["a converted machine note's original is empty"]
    missing = [key for key in MACHINE_KEYS if key not in note]
    if missing:
        return [f"machine note lacks {missing}"]
    if not isinstance(note["cores"], int) or isinstance(note["cores"], bool):
        return ["machine note's cores is not an int"]
    return []


def write_result(doc: Mapping[str, Any], out: Path, stem: str,
                 markdown: str | None = None) -> list[Path]:
    """Write ``out/<stem>.json`` (and ``out/<stem>.md`` when ``markdown`` is given) and
    return the paths. Raises ``ValueError`` before writing anything when ``doc`` is not
    a valid result document, so no bench can publish another shape."""
    problems = validate(dict(doc))
    if problems:
        raise ValueError(f"not a result document: {'; '.join(problems)}")
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{stem}.json"]
    written[0].write_text(json.dumps(doc, indent=1) + "\n")
    if markdown is not None:
        written.append(out / f"{stem}.md")
        written[1].write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    return written


def read_result(path: Path) -> dict[str, Any]:
    """The result document at ``path``; ``ValueError`` when it is not one."""
    doc: dict[str, Any] = json.loads(path.read_text())
    problems = validate(doc)
    if problems:
        raise ValueError(f"{path}: {'; '.join(problems)}")
    return doc


def kept_section(page: Path, heading: str) -> str:
    """The hand-written part of a results page that survives a rerun: ``page``'s text
    from ``heading`` to its end (one trailing newline), or ``""`` where there is none."""
    text = page.read_text() if page.exists() else ""
    return text[text.index(heading):].rstrip("\n") + "\n" if heading in text else ""


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]],
                   align: str | None = None) -> list[str]:
    """A markdown table's lines: ``headers``, then one line per row (cells by ``str``).

    ``align`` holds one character per column, ``l`` or ``r`` (default: the first column
    left, the rest right, as numbers read). A row of another width is a ``ValueError``.
    """
    width = len(headers)
    align = align or "l" + "r" * (width - 1)
    if len(align) != width:
        raise ValueError(f"{len(align)} alignments for {width} columns")
    rule = {"l": "---", "r": "---:"}
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join(rule[a] for a in align) + "|"]
    for row in rows:
        cells = [str(cell) for cell in row]
        if len(cells) != width:
            raise ValueError(f"a row of {len(cells)} cells under {width} headers")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def size_label(nbytes: int) -> str:
    """``nbytes`` as the pages write sizes: whole MiB from 1 MiB up, else KiB."""
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def drop_page_cache(paths: Sequence[Path]) -> None:
    """Evict ``paths`` from the page cache (``fsync`` then ``POSIX_FADV_DONTNEED``) so
    the next read goes to the device: unprivileged, per file."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_threads(threads: int, fn: Callable[[int], object], n: int) -> float:
    """Wall seconds for ``fn(0) .. fn(n - 1)`` on a pool of ``threads`` (the pool is
    started before the clock)."""
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(fn, range(n)))
        return time.perf_counter() - start
