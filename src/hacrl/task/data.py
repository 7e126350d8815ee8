"""Task data: the built-in procedural arithmetic task and a loader for local problem files
(their formats and field mapping: :mod:`hacrl.task.sources`).

A problem is a dict ``{"id", "problem", "answer", "level"}``; the answer is the text a model
writes inside ``\\boxed{...}``. The procedural task is deterministic from the seed, and its
train / dev / held-out problems are disjoint by construction: each problem's split is fixed by
a hash of its text, so no seed or size change can leak a held-out problem into training.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

from hacrl.config.schema import FieldsConfig
from hacrl.errors import DataError
from hacrl.task import sources

log = logging.getLogger(__name__)


Problem = dict


def _add(r: random.Random, m: int) -> tuple[str, str]:
    a, b = r.randint(0, m), r.randint(0, m)
    return f"{a}+{b}", str(a + b)


def _sub(r: random.Random, m: int) -> tuple[str, str]:
    a, b = r.randint(0, m), r.randint(0, m)
    a, b = max(a, b), min(a, b)
    return f"{a}-{b}", str(a - b)


def _add3(r: random.Random, m: int) -> tuple[str, str]:
    # two steps: a + b - c, kept non-negative
    a, b, c = r.randint(0, m), r.randint(0, 9), r.randint(0, 9)
    if a + b < c:
        a, c = c, a
        if a + b < c:
            c = 0
    return f"{a}+{b}-{c}", str(a + b - c)


def _mul(r: random.Random, m: int) -> tuple[str, str]:
    a, b = r.randint(0, m), r.randint(0, 9)
    return f"{a}*{b}", str(a * b)


def _frac(r: random.Random, m: int) -> tuple[str, str]:
    d = r.randint(2, 9)
    a, b = r.randint(1, d - 1), r.randint(1, d - 1)
    s = Fraction(a, d) + Fraction(b, d)
    ans = str(s.numerator) if s.denominator == 1 else f"\\frac{{{s.numerator}}}{{{s.denominator}}}"
    return f"{a}/{d}+{b}/{d}", ans


GENERATORS: dict[str, Callable[[random.Random, int], tuple[str, str]]] = {
    "add": _add, "sub": _sub, "add3": _add3, "mul": _mul, "frac": _frac,
}


def problem_text(expr: str) -> str:
    return f"Compute {expr}."


def split_bucket(text: str) -> float:
    """A stable number in [0, 1) from the problem text: decides the problem's split."""
    h = hashlib.sha1(text.encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def split_of(text: str, heldout_fraction: float) -> str:
    b = split_bucket(text)
    if b < heldout_fraction / 4:
        return "dev"
    if b < heldout_fraction:
        return "heldout"
    return "train"


def generate_split(split: str, size: int, levels: dict[str, float], max_operand: int,
                   heldout_fraction: float, seed: int, unique: bool = True) -> list[Problem]:
    """Draw ``size`` problems of one split, levels mixed by weight, deterministic from seed."""
    r = random.Random(f"{seed}/{split}")
    names = [k for k, w in levels.items() if float(w) > 0]
    weights = [float(levels[k]) for k in names]
    out: list[Problem] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < size:
        tries += 1
        if tries > 200 * size + 10000:
            raise DataError(f"procedural: the {split} split of levels {names} has fewer than "
                            f"{size} distinct problems (got {len(out)}); lower its size")
        lvl = r.choices(names, weights)[0]
        expr, ans = GENERATORS[lvl](r, max_operand)
        text = problem_text(expr)
        if split_of(text, heldout_fraction) != split or (unique and text in seen):
            continue
        seen.add(text)
        out.append({"id": f"{split}-{len(out):06d}", "problem": text, "answer": ans, "level": lvl})
    return out


def load_problems(path: str | Path, on_bad_row: str = "error", fmt: str = "auto",
                  fields: FieldsConfig | None = None, answer_format: str = "raw") -> tuple[list[Problem], int]:
    """Load the problems of a task file (JSONL, Parquet or a ``datasets.save_to_disk``
    directory; ``hacrl.task.sources``), fields mapped by ``fields``, the gold answer taken from
    its field as ``answer_format`` says.

    Returns (problems, skipped). A malformed row raises ``DataError("file:line: why")``, or is
    skipped and counted when ``on_bad_row == "skip"``. Two rows with one id are refused whatever
    ``on_bad_row`` says (a later stage joins rows by id).
    """
    path = Path(path)
    fields = fields or FieldsConfig()
    out: list[Problem] = []
    first: dict[str, str] = {}  # id -> where it first appeared
    skipped = 0
    for where, n, rec in sources.read_rows(path, fmt):
        got = sources.to_problem(rec, fields, answer_format, f"{path.stem}-{n:06d}")
        if isinstance(got, str):
            if on_bad_row == "skip":
                skipped += 1
                continue
            raise DataError(got if isinstance(rec, DataError) else f"{where}: {got}")
        if got["id"] in first:
            raise DataError(f"{where}: id {got['id']!r} already used at {first[got['id']]}; task ids must be "
                            f"unique (data.fields.id={fields.id})")
        first[got["id"]] = where
        out.append(got)
    if skipped:
        log.warning("%s: skipped %d malformed rows", path, skipped)
    if not out:
        raise DataError(f"{path}: no valid rows")
    return out, skipped


def problem_key(text: str) -> str:
    """A problem's text with case and runs of whitespace ignored: what makes two rows one problem."""
    return " ".join(text.lower().split())


def heldout_overlap(heldout: list[Problem], seen: list[Problem]) -> list[int]:
    """Indices of the held-out problems whose text (:func:`problem_key`) is also in ``seen``
    (train and dev). Ids are not compared: per-split files (verl's ``extra_info.index``) number
    their rows from 0 each, so equal ids across files are normal."""
    keys = {problem_key(p["problem"]) for p in seen}
    return [i for i, p in enumerate(heldout) if problem_key(p["problem"]) in keys]


def write_jsonl(path: str | Path, problems: list[Problem]) -> None:
    from hacrl.storage import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(p) + "\n" for p in problems))


def read_jsonl(path: str | Path) -> list[Problem]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_split(tasks_dir: str | Path, name: str) -> list[Problem]:
    """One split of the prepared task data (``train``, ``dev`` or ``heldout``) in ``tasks_dir``."""
    return read_jsonl(Path(tasks_dir) / f"{name}.jsonl")


def completion_text(answer: str) -> str:
    """The supervised target after the prompt (the RL reward checks only the boxed answer)."""
    return f" \\boxed{{{answer}}}"


COMPLETIONS = ("answer", "worked")
"""What the warm-up teaches an agent to write (``data.completion``): the boxed ``answer`` alone,
or a short ``worked`` solution (column sums with carries, borrows, partial results) before it."""


def _digits(n: int, width: int) -> list[int]:
    """The decimal digits of ``n``, units first, padded with zeros to ``width``."""
    return [(n // 10**i) % 10 for i in range(width)]


def _column_add(a: int, b: int) -> list[str]:
    width = max(len(str(a)), len(str(b)))
    steps, carry = [], 0
    for x, y in zip(_digits(a, width), _digits(b, width)):
        s = x + y + carry
        steps.append(f"{x}+{y}" + ("+1" if carry else "") + f"={s}")
        carry = s // 10
    return steps


def _column_sub(a: int, b: int) -> list[str]:
    width = len(str(a))
    steps, borrow = [], 0
    for x, y in zip(_digits(a, width), _digits(b, width)):
        top = x - borrow
        borrow = 1 if top < y else 0
        steps.append((f"1{x}" if borrow else f"{x}") + ("-1" if top != x else "") + f"-{y}={top + 10 * borrow - y}")
    return steps


def _column_mul(a: int, b: int) -> list[str]:
    steps, carry = [], 0
    for x in _digits(a, len(str(a))):
        s = x * b + carry
        steps.append(f"{x}*{b}" + (f"+{carry}" if carry else "") + f"={s}")
        carry = s // 10
    return steps


def worked_solution(problem: Problem) -> str:
    """A short worked solution of a procedural problem, then its boxed answer: the written
    column method, units first (``add``, ``sub``, ``mul``), partial results (``add3``), the sum
    of numerators (``frac``). Only the boxed answer is scored."""
    import re

    expr = problem["problem"].removeprefix("Compute ").removesuffix(".")
    nums = [int(x) for x in re.findall(r"\d+", expr)]
    level = problem.get("level")
    if level == "add":
        steps = _column_add(*nums)
    elif level == "sub":
        steps = _column_sub(*nums)
    elif level == "add3":
        a, b, c = nums
        steps = [f"{a}+{b}={a + b}", f"{a + b}-{c}={a + b - c}"]
    elif level == "mul":
        steps = _column_mul(*nums)
    elif level == "frac":
        a, d, b, _ = nums
        steps = [f"{a}+{b}={a + b} over {d}"]
    else:
        raise DataError(f"problem {problem.get('id')!r}: no worked solution for level {level!r} "
                        "(data.completion=worked needs the procedural task)")
    return " " + ", ".join(steps) + ", so" + completion_text(problem["answer"])


def target_text(problem: Problem, completion: str = "answer") -> str:
    """The warm-up's target after the prompt: see :data:`COMPLETIONS`."""
    return worked_solution(problem) if completion == "worked" else completion_text(problem["answer"])


def prompts_for_iteration(train: list[Problem], n: int, seed: int, iteration: int) -> list[Problem]:
    """The step's prompts: the same for every agent, chosen from seed and iteration."""
    r = random.Random(f"{seed}/prompts/{iteration}")
    idx = r.sample(range(len(train)), k=min(n, len(train)))
    return [train[i] for i in idx]
