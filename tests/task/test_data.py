import json
from fractions import Fraction

import pytest

from hacrl.config.schema import FieldsConfig
from hacrl.errors import DataError
from hacrl.task import data, sources
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
    (tmp_path / "a.jsonl").write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    pd.DataFrame(rows[:1]).to_parquet(tmp_path / "a.parquet")
    got, skipped = data.load_problems(tmp_path / "a.jsonl")
    assert [g["answer"] for g in got] == ["4", "1.5"] and skipped == 0
    assert [g["id"] for g in got] == ["a-000001", "a-000003"]  # an id without one names its line
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
    from hacrl.task.sources import MAX_ANSWER_CHARS, MAX_LINE_BYTES, MAX_PROBLEM_CHARS

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


# ----------------------------------------------------------------------------- formats researchers bring

def _verl_rows() -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": f"What is {a}+{a}? Let's think step by step and output the "
                                                    "final answer after \"####\"."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
             "extra_info": {"split": "train", "index": a}} for a in range(1, 5)]


def test_verl_parquet_takes_the_last_user_message_and_the_ground_truth(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hacrl.pipeline import params

    f = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows()), f)
    d = params.compose(["data=parquet", f"data.train_path={f}", f"data.heldout_path={f}"])["data"]
    assert (d["format"], d["fields"]["problem"], d["fields"]["answer"]) == ("parquet", "prompt",
                                                                           "reward_model.ground_truth")
    got, skipped = load_problems(f, "error", d["format"], FieldsConfig(**d["fields"]), d["answer_format"])
    assert skipped == 0 and [g["answer"] for g in got] == ["2", "4", "6", "8"]
    assert got[0]["problem"].startswith("What is 1+1? Let's think") and got[0]["id"] == "1"
    assert got[0]["level"] == "openai/gsm8k"
    # a bad row: no user message in its chat; named by file and row
    rows = _verl_rows()
    rows[2]["prompt"] = [{"role": "system", "content": "hi"}]
    pq.write_table(pa.Table.from_pylist(rows), f)
    with pytest.raises(DataError, match=rf"^{f}: row 3: field 'prompt': a chat without a user message"):
        load_problems(f, "error", "parquet", FieldsConfig(**d["fields"]), "raw")
    got, skipped = load_problems(f, "skip", "parquet", FieldsConfig(**d["fields"]), "raw")
    assert len(got) == 3 and skipped == 1


def test_hf_disk_directory_is_read_with_load_from_disk(tmp_path):
    import datasets

    rows = [{"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
             "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72"},
            {"question": "A big number?", "answer": "It is 1,000 plus 234.\n#### 1,234"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "gsm8k"))
    fields = FieldsConfig(problem="question", answer="answer")
    got, _ = load_problems(tmp_path / "gsm8k", fmt="hf_disk", fields=fields, answer_format="gsm8k")
    assert [g["answer"] for g in got] == ["72", "1234"] and got[0]["problem"].startswith("Natalia")
    assert [g["id"] for g in got] == ["gsm8k-000001", "gsm8k-000002"]
    # auto: a directory is a saved dataset
    assert load_problems(tmp_path / "gsm8k", fields=fields, answer_format="gsm8k")[0] == got
    # a bad row: no '####'
    datasets.Dataset.from_list(rows + [{"question": "Q?", "answer": "no marker"}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match=r"bad: row 3: field 'answer': it holds no '#### <answer>' "
                                        r"\(data.answer_format=gsm8k\)"):
        load_problems(tmp_path / "bad", fmt="hf_disk", fields=fields, answer_format="gsm8k")
    # a DatasetDict names its splits
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"a DatasetDict with splits train; name one split's directory"):
        load_problems(tmp_path / "dd", fmt="hf_disk", fields=fields)


def test_jsonl_field_mapping_and_math_boxed_gold(tmp_path):
    f = tmp_path / "math.jsonl"
    rows = [{"uid": "m1", "question": "Simplify 2/4.", "type": "Prealgebra",
             "solution": "Divide both by 2: $\\frac{2}{4} = \\boxed{\\frac{1}{2}}$."},
            {"uid": "m2", "question": "What is $\\sqrt{16}$?", "type": "Algebra",
             "solution": "First \\boxed{3} is wrong; $4^2 = 16$, so the answer is $\\boxed{4}$."},
            {"uid": "m3", "question": "Nested?", "type": "Algebra", "solution": "\\boxed{\\{1, {2}\\}}"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = FieldsConfig(id="uid", problem="question", answer="solution", level="type")
    got, _ = load_problems(f, fields=fields, answer_format="boxed")
    assert [(g["id"], g["answer"], g["level"]) for g in got] == [
        ("m1", "\\frac{1}{2}", "Prealgebra"), ("m2", "4", "Algebra"), ("m3", "\\{1, {2}\\}", "Algebra")]
    f.write_text(f.read_text() + json.dumps({"uid": "m4", "question": "Q?", "solution": "no box"}) + "\n")
    with pytest.raises(DataError, match=rf"^{f}:4: field 'solution': it holds no \\boxed"):
        load_problems(f, fields=fields, answer_format="boxed")
    # the mapping names a field the rows lack: said with the setting to change
    with pytest.raises(DataError, match=rf"^{f}:1: missing field 'problem' \(data.fields.problem\)"):
        load_problems(f)


def test_duplicate_task_ids_are_refused_with_both_places(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"id": i, "problem": f"{i}+1?", "answer": "1"}) + "\n" for i in ("a", "b", "a")))
    for mode in ("error", "skip"):
        with pytest.raises(DataError, match=rf"^{f}:3: id 'a' already used at {f}:1"):
            load_problems(f, mode)


def test_gold_extraction_shapes():
    assert sources.last_boxed("a \\boxed{1} b \\boxed{2}") == "2"
    assert sources.last_boxed("\\fbox{x^{2}}") == "x^{2}"
    assert sources.last_boxed("\\boxed{unclosed") is None and sources.last_boxed("none") is None
    assert sources.gsm8k_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert sources.gsm8k_answer("#### 1,234,567") == "1234567" and sources.gsm8k_answer("#### -3.5") == "-3.5"
    assert sources.gsm8k_answer("no marker") is None and sources.gsm8k_answer("####  ") is None


@pytest.mark.parametrize("fmt,field", [("raw", "5."), ("raw", "5,"), ("raw", " 5 ; "), ("gsm8k", "so it is 5\n#### 5."),
                                       ("boxed", "thus \\boxed{5.}")])
def test_a_gold_answer_with_trailing_punctuation_scores_the_right_answer_correct(fmt, field):
    """``5.`` as gold made math-verify score every answer to the prompt wrong: the sentence
    punctuation goes, in every answer format; a factorial's ``!`` and a decimal point stay."""
    from hacrl.task import rewards

    gold = sources.extract_answer(field, fmt)
    assert gold == "5"
    assert rewards.verdict(gold, "\\boxed{5}") == "correct" and rewards.verdict(gold, "\\boxed{6}") == "wrong"
    assert sources.extract_answer("5!", "raw") == "5!" and sources.extract_answer("3.5.", "raw") == "3.5"


def test_prepare_data_reads_a_saved_dataset_through_the_config(tmp_path, monkeypatch):
    import datasets

    from hacrl.pipeline import params
    from hacrl.pipeline.stages.prepare_data import prepare_data

    def rows(lo):
        return [{"question": f"What is {i} + {i}?", "answer": f"Twice {i}.\n#### {2 * i:,}"} for i in range(lo, lo + 30)]

    for split, lo in (("train", 995), ("test", 2000)):
        datasets.Dataset.from_list(rows(lo)).save_to_disk(str(tmp_path / "gsm" / split))
    d = params.compose(["data=hf_disk", f"data.train_path={tmp_path / 'gsm' / 'train'}",
                        f"data.heldout_path={tmp_path / 'gsm' / 'test'}", "data.fields.problem=question",
                        "data.answer_format=gsm8k", "data.dev_size=5"])
    monkeypatch.chdir(tmp_path)  # the stage writes data/tasks under the working directory
    cfg = params.from_dict(d)
    assert cfg.data.format == "hf_disk" and cfg.data.fields.problem == "question"
    res = prepare_data(cfg)
    assert res.metrics["tasks/train"] + res.metrics["tasks/dev"] == 30 and res.metrics["tasks/heldout"] == 30
    from hacrl.storage import RunLayout

    held = data.read_jsonl(tmp_path / RunLayout().tasks / "heldout.jsonl")
    assert held[0] == {"id": "test-000001", "problem": "What is 2000 + 2000?", "answer": "4000", "level": "all"}


def test_a_heldout_set_that_overlaps_train_is_refused_or_dropped_and_counted(tmp_path, monkeypatch):
    """Held-out accuracy measured on training problems is refused; with heldout_overlap=drop the
    shared problems leave the held-out set and the manifest counts them. Text, not ids, decides:
    case and spacing aside."""
    import json

    from hacrl.errors import DataError
    from hacrl.pipeline import params
    from hacrl.pipeline.stages.prepare_data import prepare_data

    train = [{"id": str(i), "problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(50)]
    held = [{"id": str(i), "problem": f"what is  {i} + 1?" if i < 3 else f"What is {i} + 2?", "answer": "0"}
            for i in range(20)]  # 3 leaked (other case, other spacing); equal ids alone are no leak
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    monkeypatch.chdir(tmp_path)
    base = ["data=files", f"data.train_path={tmp_path / 'train.jsonl'}", f"data.heldout_path={tmp_path / 'held.jsonl'}",
            "data.dev_size=5"]
    with pytest.raises(DataError, match=r"held\.jsonl: 3 of 20 held-out problems are also training or dev problems"):
        prepare_data(params.from_dict(params.compose(base)))
    from hacrl.storage import RunLayout

    assert not (tmp_path / RunLayout().tasks).exists()  # nothing written
    res = prepare_data(params.from_dict(params.compose(base + ["data.heldout_overlap=drop"])))
    assert res.metrics["tasks/heldout"] == 17
    manifest = json.loads((tmp_path / RunLayout().tasks / "manifest.json").read_text())
    assert manifest["heldout_overlap_dropped"] == 3


def test_the_schema_offers_exactly_the_formats_the_task_reads():
    """``data.format`` and ``data.answer_format`` are named once each: the schema's choices are
    the task's tables (plus ``auto``, which picks a reader by the path)."""
    import dataclasses

    from hacrl.config.schema import DataConfig
    from hacrl.task.sources import ANSWER_FORMATS, READERS

    rules = {f.name: f.metadata["rule"] for f in dataclasses.fields(DataConfig) if "rule" in f.metadata}
    assert set(rules["format"].choices) == {"auto", *READERS}
    assert set(rules["answer_format"].choices) == set(ANSWER_FORMATS)
