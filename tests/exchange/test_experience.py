"""SEE: typed record shards (schema checks with one-line errors), publish, subscription filters,
pooled reward statistics."""

import subprocess
import sys

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SMOKE, plain

from hacrl.config.schema import StreamConfig
from hacrl.errors import ConfigError
from hacrl.exchange.experience import SCHEMA_VERSION, SCHEMAS, SchemaError, publish, read_records, select, write_records
from hacrl.groups import pooled_reward_stats
from hacrl.pipeline import params


def rollout_df(producer: str, prompts=("p1", "p2"), g: int = 3) -> pd.DataFrame:
    rows = []
    for p in prompts:
        for i in range(g):
            rows.append({"record_id": f"it1/{producer}/{p}/{i}", "schema_version": SCHEMA_VERSION, "step": 1,
                         "producer": producer, "producer_tokenizer": "tok", "prompt_id": p, "problem": "1+1",
                         "gold": "2", "level": "add", "rendered_prompt": "Q: 1+1\nA:", "prompt_token_ids": [1, 2],
                         "response_text": f" \\boxed{{{i}}}", "response_token_ids": [5, 6, 7],
                         "response_logprobs": [-0.1, -0.2, -0.3], "finish_reason": "stop", "sample_index": i})
    return pd.DataFrame(rows)


def verdicts_for(ro: pd.DataFrame, correct) -> pd.DataFrame:
    """``correct``: record index -> verdict string (default wrong); reward 1 for correct."""
    v = [correct.get(i, "wrong") for i in range(len(ro))]
    return pd.DataFrame({"record_id": ro["record_id"], "schema_version": SCHEMA_VERSION, "producer": ro["producer"],
                         "prompt_id": ro["prompt_id"], "verdict": v,
                         "reward": [1.0 if x == "correct" else (None if x == "gold_unparseable" else 0.0) for x in v]})


def test_written_shards_read_back_with_their_types(tmp_path):
    ro = rollout_df("a")
    write_records(tmp_path / "r.parquet", ro, "rollout")
    back = read_records(tmp_path / "r.parquet", "rollout")
    assert list(back.columns) == SCHEMAS["rollout"].names and len(back) == len(ro)
    assert list(back["response_logprobs"].iloc[0]) == [-0.1, -0.2, -0.3]
    meta = pq.read_schema(tmp_path / "r.parquet").metadata
    assert meta[b"hacrl.schema"] == b"rollout" and int(meta[b"hacrl.schema_version"]) == SCHEMA_VERSION


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_writing_refuses_a_missing_an_unexpected_or_a_mistyped_field(tmp_path):
    ro = rollout_df("a")
    f = tmp_path / "r.parquet"
    with pytest.raises(SchemaError) as e:
        write_records(f, ro.drop(columns=["response_logprobs"]), "rollout")
    assert "missing field 'response_logprobs'" in _one_line(e)
    with pytest.raises(SchemaError) as e:
        write_records(f, ro.assign(bogus=1), "rollout")
    assert "unexpected field 'bogus'" in _one_line(e)
    with pytest.raises(SchemaError) as e:
        write_records(f, ro.assign(step="one"), "rollout")
    assert str(f) in _one_line(e)
    assert not f.exists(), "a refused shard leaves nothing behind"


def _write_raw(path, df: pd.DataFrame, schema: pa.Schema | None = None, meta: dict | None = None):
    table = pa.Table.from_pandas(df, schema=schema, preserve_index=False)
    pq.write_table(table.replace_schema_metadata(meta) if meta is not None else table, path)


def test_reading_names_the_file_the_version_and_the_field(tmp_path):
    ro = rollout_df("a")
    good = {b"hacrl.schema": b"rollout", b"hacrl.schema_version": str(SCHEMA_VERSION).encode()}
    f = tmp_path / "wrong_version.parquet"
    _write_raw(f, ro, SCHEMAS["rollout"], {**good, b"hacrl.schema_version": b"7"})
    with pytest.raises(SchemaError) as e:
        read_records(f, "rollout")
    msg = _one_line(e)
    assert str(f) in msg and "unknown schema_version 7" in msg and "dvc repro --force generate-rollouts" in msg
    f = tmp_path / "missing.parquet"
    _write_raw(f, ro.drop(columns=["finish_reason"]), None, good)
    with pytest.raises(SchemaError) as e:
        read_records(f, "rollout")
    assert str(f) in _one_line(e) and "field 'finish_reason' missing" in _one_line(e)
    f = tmp_path / "mistyped.parquet"
    _write_raw(f, ro.assign(response_logprobs=[[1, 2]] * len(ro)), None, good)  # ints, not doubles
    with pytest.raises(SchemaError) as e:
        read_records(f, "rollout")
    assert "field 'response_logprobs' has type list<item: int64>" in _one_line(e)
    f = tmp_path / "other_type.parquet"
    write_records(f, ro, "rollout")
    with pytest.raises(SchemaError) as e:
        read_records(f, "trajectory")
    assert "holds rollout records, expected trajectory" in _one_line(e)
    f = tmp_path / "no_version.parquet"  # a rollout shard of an earlier hacrl: no version at all
    ro.drop(columns=["schema_version"]).to_parquet(f, index=False)
    with pytest.raises(SchemaError) as e:
        read_records(f, "rollout")
    assert "unknown schema_version missing" in _one_line(e)


def test_a_v1_experience_shard_still_reads_as_trajectories(tmp_path):
    pub = publish(rollout_df("a"), verdicts_for(rollout_df("a"), {0: "correct"}))["trajectory"]
    v1 = pub.drop(columns=["record_type"]).assign(schema_version=1)
    f = tmp_path / "experience.parquet"
    v1.to_parquet(f, index=False)  # as version 1 wrote it: a column, no file metadata
    back = read_records(f, "trajectory")
    assert (back["record_type"] == "trajectory").all() and (back["schema_version"] == SCHEMA_VERSION).all()
    assert plain(back.drop(columns=["schema_version"])) == plain(pub.drop(columns=["schema_version"]))


def test_publish_types_every_record():
    ro = rollout_df("a", g=4)
    pub = publish(ro, verdicts_for(ro, {0: "correct", 1: "correct", 4: "gold_unparseable", 5: "correct"}))
    traj, succ, stats = pub["trajectory"], pub["verified_success"], pub["reward_stats"]
    assert len(traj) == 7 and (traj["record_type"] == "trajectory").all()  # the unparseable one is dropped
    assert list(succ["record_id"]) == [ro["record_id"][i] for i in (0, 1, 5)]
    assert (succ["record_type"] == "verified_success").all()
    p1 = stats.set_index("prompt_id").loc["p1"]
    assert (p1["n"], p1["successes"], p1["mean"]) == (4, 2, 0.5)
    assert p1["std"] == pytest.approx(pd.Series([1.0, 1.0, 0.0, 0.0]).std(ddof=1))
    p2 = stats.set_index("prompt_id").loc["p2"]
    assert (p2["n"], p2["successes"]) == (3, 1)
    # the producer's own group advantage: positive for the successes, 0-mean per prompt
    assert traj.groupby("prompt_id")["advantage"].sum().abs().max() < 1e-5


@pytest.fixture
def published():
    out = {}
    for j, name in enumerate(("a", "b", "c")):
        ro = rollout_df(name)
        out[name] = publish(ro, verdicts_for(ro, {j: "correct", 3: "no_answer"}))
    return out


@pytest.mark.parametrize("producers, verdicts, expected", [
    ("self", None, {("b", i) for i in range(6)}),
    ("peers", None, {(p, i) for p in "ac" for i in range(6)}),
    ("all", None, {(p, i) for p in "abc" for i in range(6)}),
    ("peers", ["correct"], {("a", 0), ("c", 2)}),
    ("all", ["no_answer"], {(p, 3) for p in "abc"}),
])
def test_a_subscription_selects_exactly_the_declared_records(published, producers, verdicts, expected):
    got = select(published, "b", StreamConfig("trajectory", producers, verdicts))
    ids = {(r.split("/")[1], ["p1", "p2"].index(r.split("/")[2]) * 3 + int(r.split("/")[3])) for r in got["record_id"]}
    assert ids == expected
    assert list(got.columns) == SCHEMAS["trajectory"].names


def test_verified_success_and_reward_stats_streams(published):
    succ = select(published, "a", StreamConfig("verified_success", "peers"))
    assert sorted(succ["record_id"]) == ["it1/b/p1/1", "it1/c/p1/2"]
    stats = select(published, "a", StreamConfig("reward_stats", "all"))
    assert len(stats) == 3 * 2 and set(stats["producer"]) == {"a", "b", "c"}


def test_pooled_reward_stats_equal_the_statistics_of_the_pooled_rewards(published):
    rewards = pd.concat([published[p]["trajectory"] for p in "abc"]).groupby("prompt_id")["reward"]
    pooled = pooled_reward_stats(pd.concat([published[p]["reward_stats"] for p in "abc"])).set_index("prompt_id")
    for pid, r in rewards:
        assert pooled.loc[pid, "n"] == len(r)
        assert pooled.loc[pid, "mean"] == pytest.approx(r.mean())
        assert pooled.loc[pid, "std"] == pytest.approx(r.std(ddof=1))


def test_the_cli_reports_a_damaged_shard_in_one_line(tmp_path):
    data = params.compose(SMOKE)
    params.write_params(data, tmp_path / "params.yaml")
    shard = tmp_path / "runs" / "it1" / "rollouts" / "gpt2-a.parquet"
    shard.parent.mkdir(parents=True)
    rollout_df("gpt2-a").drop(columns=["response_token_ids"]).to_parquet(shard, index=False)
    p = subprocess.run([sys.executable, "-m", "hacrl.cli", "stage", "verify-rewards", "-t", "1"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("hacrl: error: ") and "runs/it1/rollouts/gpt2-a.parquet" in last
    assert not (tmp_path / "runs" / "it1" / "rewards").exists()


def test_a_metadata_less_shard_of_another_record_type_is_refused(tmp_path, published):
    f = tmp_path / "t.parquet"
    published["a"]["trajectory"].to_parquet(f, index=False)  # no file metadata
    assert len(read_records(f, "trajectory")) == 6
    with pytest.raises(SchemaError, match="holds trajectory records, expected verified_success"):
        read_records(f, "verified_success")


@pytest.mark.parametrize("subscription, why", [
    ([{"record_type": "trajectory", "producers": "self"}, {"record_type": "verified_success", "producers": "all"}],
     "overlaps stream 0"),
    ([{"record_type": "trajectory", "producers": "all"}, {"record_type": "trajectory", "producers": "peers"}],
     "overlaps stream 0"),
    ([{"record_type": "trajectory", "producers": "self"}, {"record_type": "reward_stats", "producers": "all"},
      {"record_type": "reward_stats", "producers": "self"}], "overlaps stream 1"),
    ([{"record_type": "trajectory", "producers": "peers", "verdicts": ["corect"]}], "verdicts are correct"),
    ([{"record_type": "trajectory", "producers": "self"},
      {"record_type": "reward_stats", "producers": "all", "verdicts": ["correct"]}], "carry no verdict"),
])
def test_a_subscription_that_would_count_records_twice_or_select_nothing_is_refused(subscription, why):
    data = params.compose([])
    data["algorithm"]["subscription"] = subscription
    with pytest.raises(ConfigError, match=why):
        params.from_dict(data)
    ok = params.compose(["algorithm.name=grpo_with_successes"])  # disjoint streams are fine: own
    # trajectories and peers' successes (a variant of the grpo preset: its own label)
    ok["algorithm"]["subscription"] = [{"record_type": "trajectory", "producers": "self"},
                                       {"record_type": "verified_success", "producers": "peers"}]
    params.from_dict(ok)


def test_an_estimator_is_refused_without_the_records_it_needs():
    data = params.compose(["algorithm=xgrpo"])
    data["algorithm"]["subscription"] = [{"record_type": "trajectory", "producers": "self"}]
    with pytest.raises(ConfigError, match="the xgrpo advantage needs a reward_stats stream"):
        params.from_dict(data)
    data = params.compose(["algorithm=hacpo"])
    data["algorithm"]["loss"]["alpha"] = "three"
    with pytest.raises(ConfigError, match=r"^algorithm.loss.alpha: invalid value 'three' \(expected a finite number\)"):
        params.from_dict(data)


@pytest.mark.parametrize("peer_eos", ["keep_if_stopped", "drop"])
def test_peer_eos_decides_the_eos_on_both_sides(peer_eos, tiny_problems):
    from hacrl.agents.pool import train_tokenizer
    from hacrl.config.schema import ThlConfig, TokenizerConfig
    from hacrl.exchange.experience import adapt_response
    from hacrl.task.data import completion_text

    corpus = ["Q: " + p["problem"] + "\nA:" + completion_text(p["answer"]) for p in tiny_problems["train"]]
    src = train_tokenizer(TokenizerConfig(kind="bytelevel_bpe", vocab_size=300), corpus)
    dst = train_tokenizer(TokenizerConfig(kind="metaspace_bpe", vocab_size=100), corpus)
    text = " \\boxed{42}"
    ids = src(text, add_special_tokens=False)["input_ids"] + [src.eos_token_id]
    lps = [-0.5] * (len(ids) - 1) + [-2.0]  # the EOS has its own log-prob
    rec = pd.Series({"response_text": text, "response_token_ids": ids, "response_logprobs": lps,
                     "finish_reason": "stop"})
    ad = adapt_response(rec, src, dst, ThlConfig(peer_eos=peer_eos))
    body = dst(text, add_special_tokens=False)["input_ids"]
    if peer_eos == "drop":  # official HACPO: no EOS on either side, the mean without it
        assert ad.ids == body and ad.behavior_mean == pytest.approx(-0.5)
        assert ad.alignment.aligned_mass == pytest.approx(-0.5 * (len(ids) - 1))
    else:  # the learner's EOS appended and given the producer's EOS log-prob
        assert ad.ids == body + [dst.eos_token_id] and ad.alignment.aligned[-1] == -2.0
        assert ad.behavior_mean == pytest.approx(sum(lps) / len(lps))
    assert ad.alignment.aligned_mass == pytest.approx(ad.alignment.source_mass) and ad.exact


def test_the_oracle_stream_injects_the_gold_completion_on_the_same_rows(published, tiny_problems):
    """``content: gold`` (SGT's oracle control): the same peer rows as the peers' responses, so
    the same gates, but each carries the task's gold completion in the learner's own tokens."""
    from hacrl.agents.pool import train_tokenizer
    from hacrl.config.schema import ThlConfig, TokenizerConfig
    from hacrl.exchange.experience import LearnerView, subscribe
    from hacrl.task.data import completion_text

    corpus = ["Q: " + p["problem"] + "\nA:" + completion_text(p["answer"]) for p in tiny_problems["train"]]
    tok = train_tokenizer(TokenizerConfig(kind="bytelevel_bpe", vocab_size=300), corpus)
    toks = dict.fromkeys("abc", tok)
    view = LearnerView("a", tok, "Q: {problem}\nA:")
    streams = [StreamConfig("trajectory", "self"), StreamConfig("verified_success", "peers")]
    peer = subscribe(published, view, streams, toks, ThlConfig())
    with pytest.raises(ValueError, match="gold"):  # the stage always passes the task's completions
        subscribe(published, view, [streams[0], StreamConfig("verified_success", "peers", content="gold")], toks, ThlConfig())
    gold = subscribe(published, view, [streams[0], StreamConfig("verified_success", "peers", content="gold")], toks,
                     ThlConfig(), gold_text=lambda rec: completion_text(rec.gold))
    cross = lambda df: df[~df["is_self"].astype(bool)]  # noqa: E731
    assert list(cross(gold.rows)["record_id"]) == list(cross(peer.rows)["record_id"]) == ["it1/b/p1/1", "it1/c/p1/2"]
    want = tok(" \\boxed{2}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert [list(x) for x in cross(gold.rows)["input_response_ids"]] == [want, want]
    assert [list(x) for x in cross(peer.rows)["input_response_ids"]] != [want, want]  # the peers wrote \boxed{1}, \boxed{2}
    assert (cross(gold.rows)["response_text"] == " \\boxed{2}").all()
    assert cross(gold.rows)["behavior_logprob_mean"].isna().all() and not gold.alignments
    # the learner's own rows are untouched
    own = lambda df: df[df["is_self"].astype(bool)].reset_index(drop=True)  # noqa: E731
    pd.testing.assert_frame_equal(own(gold.rows), own(peer.rows))
    data = params.compose(["algorithm=sgt_oracle"])
    assert data["algorithm"]["subscription"][1]["content"] == "gold" and data["algorithm"]["name"] == "sgt_oracle"
    data["algorithm"]["subscription"].append({"record_type": "reward_stats", "producers": "peers", "content": "gold"})
    with pytest.raises(ConfigError, match=r"content: invalid value 'gold' \(gold only on a trajectory"):
        params.from_dict(data)
