"""Problem files as researchers bring them: the rows of a JSONL file, a Parquet file (verl's
layout among others) or a ``datasets.save_to_disk`` directory, mapped to the task's fields.

Three choices describe a file (``data.format``, ``data.fields``, ``data.answer_format``):

- **format**: ``jsonl`` (one JSON object per line), ``parquet``, ``hf_disk`` (what
  ``datasets.Dataset.save_to_disk`` wrote; read with ``datasets.load_from_disk``), or ``auto``
  (a directory is ``hf_disk``, ``*.parquet`` is Parquet, anything else JSONL).
- **fields**: which field of a row holds the id, the problem, the answer and the level. A
  dotted name reaches into nested objects (verl's ``reward_model.ground_truth``). A problem field
  that holds a chat (a list of ``{role, content}`` messages, verl's ``prompt``) gives the content
  of its last ``user`` message. Without an id field a row is named ``<file stem>-<row number>``;
  without a level field its level is ``all``.
- **answer_format**: where the gold answer sits inside the answer field: ``raw`` (the whole
  field), ``boxed`` (the content of the last ``\\boxed{...}`` of a worked solution, MATH's
  layout) or ``gsm8k`` (what follows GSM8K's ``####``, thousands separators dropped).

A row that does not fit is a :class:`~hacrl.errors.DataError` naming the file and the row (line
for JSONL), or is skipped and counted (``data.on_bad_row=skip``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hacrl.config.schema import FieldsConfig
from hacrl.errors import DataError

MAX_LINE_BYTES = 1 << 20
"""A JSONL line longer than this is refused unparsed."""
MAX_PROBLEM_CHARS = 16_384
MAX_ANSWER_CHARS = 1_024
"""Longer problems or (extracted) answers are refused (a 10 MB problem took prepare-pool past 8 GB)."""
MAX_FIELD_CHARS = 65_536
"""A worked solution the gold answer is taken from may be longer than an answer, not unbounded."""
_BATCH_ROWS = 1024  # Parquet rows decoded at a time: memory does not grow with the file


def detect_format(path: Path) -> str:
    """``auto``'s choice for ``path``."""
    if path.is_dir():
        return "hf_disk"
    return "parquet" if path.suffix.lower() in (".parquet", ".pq") else "jsonl"


def read_rows(path: Path, fmt: str) -> Iterator[tuple[str, int, object]]:
    """``(where, number, row)`` per row of the file: ``where`` is ``file:line`` (JSONL) or
    ``file: row N``, ``number`` that line or row number (a row's default id); ``row`` a dict, or a
    :class:`DataError` for a row that could not be read."""
    if not path.exists():
        raise DataError(f"{path}: file does not exist")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in READERS:
        raise DataError(f"{path}: unknown format {fmt!r} (one of auto, {', '.join(READERS)})")
    yield from READERS[fmt](path)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, int, object]]:
    if path.is_dir():
        raise DataError(f"{path}: a directory, not a JSONL file (a datasets.save_to_disk directory: "
                        "data.format=hf_disk)")
    with open(path, "rb") as f:
        for i, (raw, size) in enumerate(_capped_lines(f, MAX_LINE_BYTES), 1):
            where = f"{path}:{i}"
            if raw is None:  # never held in memory, never parsed: a task row is not megabytes long
                yield where, i, DataError(f"{where}: line of {size:,} bytes, over the {MAX_LINE_BYTES:,}-byte "
                                       "limit of a task row")
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, i, DataError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                yield where, i, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, i, DataError(f"{where}: invalid JSON ({e.msg})")


def _capped_lines(f, cap: int):
    """``(line, size)`` per line of binary file ``f``; ``(None, size)`` for a line over ``cap``
    bytes, which is skipped in chunks rather than read whole."""
    while True:
        line = f.readline(cap + 1)
        if not line:
            return
        if len(line) <= cap or line.endswith(b"\n") and len(line) <= cap + 1:
            yield line, len(line)
            continue
        size = len(line)
        while not line.endswith(b"\n"):
            line = f.readline(1 << 20)
            if not line:
                break
            size += len(line)
        yield None, size


def _parquet_rows(path: Path) -> Iterator[tuple[str, int, object]]:
    import pyarrow.parquet as pq

    n = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=_BATCH_ROWS):
            for rec in batch.to_pylist():
                n += 1
                yield f"{path}: row {n}", n, rec
    except Exception as e:  # noqa: BLE001 - any reader failure is a malformed file
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def _hf_disk_rows(path: Path) -> Iterator[tuple[str, int, object]]:
    if not path.is_dir():
        raise DataError(f"{path}: not a directory; data.format=hf_disk reads what datasets' save_to_disk wrote")
    try:
        import datasets
    except ImportError:  # a dependency of the project: only a broken environment lacks it
        raise DataError("data.format=hf_disk needs the `datasets` package (make setup installs it)") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - what load_from_disk raises varies by version
        raise DataError(f"{path}: not a datasets.save_to_disk directory ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = ", ".join(ds)
        raise DataError(f"{path}: a DatasetDict with splits {splits}; name one split's directory, e.g. "
                        f"data.train_path={path / next(iter(ds))}")
    for i, rec in enumerate(ds, 1):
        yield f"{path}: row {i}", i, rec


def field(rec: dict, name: str) -> object:
    """``rec``'s value at a dotted ``name``; :class:`KeyError` naming it when absent."""
    cur: object = rec
    for part in name.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            raise KeyError(name)
    return cur


def chat_problem(value: object) -> object:
    """A chat (a list of ``{role, content}`` messages) gives its last user message's content;
    anything else is returned as it is."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        users = [m.get("content") for m in value if m.get("role") == "user"]
        if not users:
            raise ValueError("a chat without a user message")
        return users[-1]
    return value


_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces
    balanced; None without one (or when it is not closed)."""
    opens = [m.end() for m in _BOX.finditer(text)]
    if not opens:
        return None
    depth = 1
    for j in range(opens[-1], len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[opens[-1]:j]
    return None


def gsm8k_answer(text: str) -> str | None:
    """What follows the last ``####`` of a GSM8K solution, thousands separators dropped."""
    if "####" not in text:
        return None
    ans = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.rpartition("####")[2].strip())
    return ans or None


_TRAILING_PUNCT = re.compile(r"[\s.,;:]+$")
"""Sentence punctuation after an answer (``5.``, ``5,``): math-verify reads ``5.`` as no number
equal to 5, so every response would be scored wrong. ``!`` (a factorial) is kept."""


def extract_answer(value: object, answer_format: str) -> str | None:
    """The gold answer inside an answer field, without trailing sentence punctuation; None when
    the format finds none."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"unknown answer format {answer_format!r}")
    got = ANSWER_FORMATS[answer_format].extract(str(value).strip())
    got = _TRAILING_PUNCT.sub("", got) if got is not None else None
    return got or None


def to_problem(rec: object, fields: FieldsConfig, answer_format: str, default_id: str) -> dict | str:
    """The task's problem dict from one row, or a string saying why the row does not fit."""
    if isinstance(rec, DataError):
        return str(rec)
    if not isinstance(rec, dict):
        return f"row is not an object ({type(rec).__name__})"
    got: dict[str, object] = {}
    for key, name in (("problem", fields.problem), ("answer", fields.answer)):
        try:
            got[key] = field(rec, name)
        except KeyError:
            return f"missing field {name!r} (data.fields.{key})"
        if got[key] is None:
            return f"field {name!r} is empty (data.fields.{key})"
    try:
        problem = chat_problem(got["problem"])
    except ValueError as e:
        return f"field {fields.problem!r}: {e}"
    if not isinstance(problem, str) or not problem.strip():
        return f"field {fields.problem!r} must be a non-empty string or a chat (data.fields.problem)"
    answer = got["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return f"field {fields.answer!r} must be a string or number (data.fields.answer)"
    if len(str(answer)) > MAX_FIELD_CHARS:
        return f"field {fields.answer!r} has {len(str(answer)):,} characters, over the limit of {MAX_FIELD_CHARS:,}"
    gold = extract_answer(answer, answer_format)
    if gold is None:
        return f"field {fields.answer!r}: {ANSWER_FORMATS[answer_format].missing} (data.answer_format={answer_format})"
    for what, text, limit in ((f"field {fields.problem!r}", problem, MAX_PROBLEM_CHARS),
                              (f"field {fields.answer!r}" + ("" if answer_format == "raw" else "'s gold answer"),
                               gold, MAX_ANSWER_CHARS)):
        if len(text) > limit:
            return f"{what} has {len(text):,} characters, over the limit of {limit:,}"
    out = {"id": default_id, "problem": problem.strip(), "answer": gold, "level": "all"}
    for key, name in (("id", fields.id), ("level", fields.level)):
        if name:
            try:
                v = field(rec, name)
            except KeyError:
                continue
            if v is not None and str(v).strip():
                out[key] = str(v).strip()
    return out


@dataclass(frozen=True)
class AnswerFormat:
    """Where the gold answer sits in an answer field (``data.answer_format``)."""

    extract: Callable[[str], str | None]
    """The answer in the field's text, or None."""
    missing: str
    """Why a row has none, in its error line."""


ANSWER_FORMATS: dict[str, AnswerFormat] = {
    "raw": AnswerFormat(lambda text: text, "it is empty"),
    "boxed": AnswerFormat(last_boxed, "it holds no \\boxed{...}"),
    "gsm8k": AnswerFormat(gsm8k_answer, "it holds no '#### <answer>'"),
}
"""The answer formats, by the name ``data.answer_format`` takes (the schema's choices; a test
checks that they agree)."""

READERS: dict[str, Callable[[Path], Iterator[tuple[str, int, object]]]] = {
    "jsonl": _jsonl_rows, "parquet": _parquet_rows, "hf_disk": _hf_disk_rows}
"""The file formats, by the name ``data.format`` takes besides ``auto`` (the schema's choices; a
test checks that they agree)."""

