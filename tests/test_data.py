import json
from fractions import Fraction

import pytest

from hacrl.errors import DataError
from hacrl.task import data
from hacrl.task.data import load_problems

LEVELS = {"add": 1, "sub": 1, "add3": 1, "mul": 1, "frac": 1}


def _value(expr: str) -> Fraction:
    return Fraction(eval(expr.replace("/", "*Fraction(1,1)/"), {"Fraction": Fraction}))  # noqa: S307


def test_problems_are_deterministic_and_correct():
    a = data.generate_split("train", 500, LEVELS, 99, 0.2, seed=3)
    b = data.generate_split("train", 500, LEVELS, 99, 0.2, seed=3)
    c = data.generate_split("train", 500, LEVELS, 99, 0.2, seed=4)
    assert a == b and a != c
    assert {p["level"] for p in a} == set(LEVELS)
    for p in a:
        expr = p["problem"].removeprefix("Compute ").removesuffix(".")
        ans = p["answer"]
        if ans.startswith("\\frac"):
            num, den = ans[6:-1].split("}{")
            ans = f"{num}/{den}"
        assert _value(expr) == Fraction(ans), p


def test_splits_are_disjoint_whatever_the_seed():
    train = {p["problem"] for p in data.generate_split("train", 3000, LEVELS, 99, 0.2, seed=0)}
    held = {p["problem"] for p in data.generate_split("heldout", 1000, LEVELS, 99, 0.2, seed=1)}
    dev = {p["problem"] for p in data.generate_split("dev", 200, LEVELS, 99, 0.2, seed=2)}
    assert not (train & held) and not (train & dev) and not (held & dev)


def test_too_small_a_space_is_a_clear_error():
    with pytest.raises(DataError, match="fewer than"):
        data.generate_split("heldout", 5000, {"frac": 1}, 99, 0.2, 0)


def test_prompts_for_iteration_depend_on_seed_and_iteration():
    train = data.generate_split("train", 1000, LEVELS, 99, 0.2, 0)
    p1 = data.prompts_for_iteration(train, 64, 0, 1)
    assert p1 == data.prompts_for_iteration(train, 64, 0, 1)
    assert p1 != data.prompts_for_iteration(train, 64, 0, 2)
    assert len({p["id"] for p in p1}) == 64


def test_loader_reads_jsonl_and_parquet(tmp_path):
    import pandas as pd

    rows = [{"problem": "What is 2+2?", "answer": "4"}, {"problem": "Half of 3?", "answer": 1.5}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pd.DataFrame(rows[:1]).to_parquet(tmp_path / "a.parquet")
    got, skipped = data.load_problems(tmp_path / "a.jsonl")
    assert [g["answer"] for g in got] == ["4", "1.5"] and skipped == 0
    got, _ = data.load_problems(tmp_path / "a.parquet")
    assert got[0]["problem"] == "What is 2+2?"


@pytest.mark.parametrize("bad_line, why", [
    ('{"problem": "x"}', "missing field 'answer'"),
    ('{"problem": "", "answer": "1"}', "non-empty string"),
    ('not json', "invalid JSON"),
    ('[1, 2]', "not an object"),
])
def test_malformed_row_fails_with_file_and_line_or_is_skipped(tmp_path, bad_line, why):
    f = tmp_path / "train.jsonl"
    f.write_text('{"problem": "1+1?", "answer": "2"}\n' + bad_line + "\n")
    with pytest.raises(DataError) as e:
        data.load_problems(f)
    assert f"{f}:2:" in str(e.value) and why in str(e.value)
    got, skipped = data.load_problems(f, on_bad_row="skip")
    assert len(got) == 1 and skipped == 1


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        data.load_problems(tmp_path / "nope.jsonl")


@pytest.mark.parametrize("level", ["add", "sub", "add3", "mul", "frac"])
def test_worked_solutions_are_correct_arithmetic_ending_in_the_answer(level):
    import re

    for p in data.generate_split("train", 150, {level: 1.0}, 99, 0.2, 3):
        text = data.target_text(p, "worked")
        body, _, tail = text.rpartition(", so ")
        assert tail == data.completion_text(p["answer"]).lstrip(), text
        for step in body.strip().split(", "):
            lhs, _, rhs = step.split(" over ")[0].partition("=")  # frac: "1+2=3 over 7"
            assert re.fullmatch(r"[\d+\-*]+", lhs) and int(rhs) == eval(lhs), (p["problem"], step)  # noqa: S307
        assert data.target_text(p) == data.completion_text(p["answer"])
    # the written column method: units first, carries and borrows shown
    assert data.worked_solution({"problem": "Compute 47+38.", "answer": "85", "level": "add"}) == \
        " 7+8=15, 4+3+1=8, so \\boxed{85}"
    assert data.worked_solution({"problem": "Compute 74-46.", "answer": "28", "level": "sub"}) == \
        " 14-6=8, 7-1-4=2, so \\boxed{28}"


def test_worked_solutions_need_the_procedural_task():
    from hacrl.errors import ConfigError
    from hacrl.pipeline import params

    with pytest.raises(DataError, match="no worked solution for level 'all'"):
        data.worked_solution({"id": "x", "problem": "What is 2+2?", "answer": "4", "level": "all"})
    d = params.compose(["data=arith_worked"])
    assert d["data"]["completion"] == "worked"
    d["data"].update(source="files", train_path=__file__, heldout_path=__file__)
    with pytest.raises(ConfigError, match="^data.completion: .*procedural task only"):
        params.from_dict(d)


def test_a_line_that_is_not_utf8_is_named_and_skip_skips_it(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_bytes(b'{"problem": "1+1?", "answer": "2"}\n{"problem": "caf\xe9?", "answer": "3"}\n'
                  b'{"problem": "2+2?", "answer": "4"}\n')
    with pytest.raises(DataError) as e:
        load_problems(f)
    assert str(e.value) == f"{f}:2: not UTF-8 (byte 0xe9 at column 17)"
    probs, skipped = load_problems(f, "skip")
    assert [p["answer"] for p in probs] == ["2", "4"] and skipped == 1


def test_oversized_problems_answers_and_lines_are_refused_before_they_cost_memory(tmp_path):
    from hacrl.task.data import MAX_ANSWER_CHARS, MAX_LINE_BYTES, MAX_PROBLEM_CHARS

    f = tmp_path / "t.jsonl"
    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "x" * (MAX_PROBLEM_CHARS + 1), "answer": "1"},
            {"problem": "2+2?", "answer": "9" * (MAX_ANSWER_CHARS + 1)}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + "y" * (MAX_LINE_BYTES + 1) + "\n")
    with pytest.raises(DataError, match=rf"{f}:2: field 'problem' has 16,385 characters, over the limit of 16,384"):
        load_problems(f)
    probs, skipped = load_problems(f, "skip")
    assert len(probs) == 1 and skipped == 3
    big = tmp_path / "big.jsonl"
    big.write_text("y" * (MAX_LINE_BYTES + 1) + "\n")
    with pytest.raises(DataError, match=r"big.jsonl:1: line of 1,048,578 bytes, over the 1,048,576-byte limit"):
        load_problems(big)
