"""SEE, the Shared Experience Exchange: typed, versioned records and publish/subscribe.

Every artifact that carries experience between stages and agents is one of the record types
below, written as Parquet with an explicit Arrow schema (docs/ALGORITHMS.md, "SEE"):

- ``rollout`` (generate-rollouts): one sampled response with the producer's token ids and
  per-token log-probs;
- ``verdict`` (verify-rewards): math-verify's verdict and reward of one rollout;
- ``trajectory`` (published in exchange-and-align): a rollout joined with its verdict and the
  producer's own group advantage;
- ``verified_success``: a trajectory whose verdict is ``correct``;
- ``reward_stats``: per producer and prompt, the scalar reward statistics (n, successes, mean,
  unbiased std);
- ``learner_input``: a learner's training rows (its own trajectories and what its subscription
  took from its peers, retokenised and aligned by THL).

Writing checks the schema (missing, unexpected or mistyped field: one-line error); reading
checks the schema name and version recorded in the file and every field. Each agent publishes
its records per iteration; each learner subscribes with the streams its algorithm's YAML
declares (``algorithm.subscription``), and its input is a pure function of the published shards,
its tokenizer and template.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from hacrl.errors import DataError
from hacrl.storage import atomic_path

SCHEMA_VERSION = 2
"""Version 1 (before the typed stream) wrote one untyped ``experience.parquet``; version 2 types
every shard. A v1 trajectory still reads (it is a v2 trajectory without ``record_type``)."""

PUBLISHED_ADV_EPS = 1e-6
"""eps of the producer's own group-normalised advantage published with each trajectory."""

_ROLLOUT = [
    ("record_id", pa.string()), ("schema_version", pa.int64()), ("step", pa.int64()),
    ("producer", pa.string()), ("producer_tokenizer", pa.string()), ("prompt_id", pa.string()),
    ("problem", pa.string()), ("gold", pa.string()), ("level", pa.string()),
    ("rendered_prompt", pa.string()), ("prompt_token_ids", pa.list_(pa.int64())),
    ("response_text", pa.string()), ("response_token_ids", pa.list_(pa.int64())),
    ("response_logprobs", pa.list_(pa.float64())), ("finish_reason", pa.string()),
    ("sample_index", pa.int64()),
]
_TRAJECTORY = [("record_type", pa.string())] + _ROLLOUT + [
    ("reward", pa.float64()), ("verdict", pa.string()), ("advantage", pa.float64()),
]
SCHEMAS: dict[str, pa.Schema] = {
    "rollout": pa.schema(_ROLLOUT),
    "verdict": pa.schema([("record_id", pa.string()), ("schema_version", pa.int64()),
                          ("producer", pa.string()), ("prompt_id", pa.string()),
                          ("verdict", pa.string()), ("reward", pa.float64())]),
    "trajectory": pa.schema(_TRAJECTORY),
    "verified_success": pa.schema(_TRAJECTORY),
    "reward_stats": pa.schema([("record_type", pa.string()), ("schema_version", pa.int64()),
                               ("step", pa.int64()), ("producer", pa.string()), ("prompt_id", pa.string()),
                               ("n", pa.int64()), ("successes", pa.int64()), ("mean", pa.float64()),
                               ("std", pa.float64())]),
    "learner_input": pa.schema(_TRAJECTORY + [
        ("learner", pa.string()), ("is_self", pa.bool_()), ("input_prompt_ids", pa.list_(pa.int64())),
        ("input_response_ids", pa.list_(pa.int64())), ("old_logprobs", pa.list_(pa.float64())),
        ("behavior_logprob_mean", pa.float64()), ("behavior_logprobs_aligned", pa.list_(pa.float64())),
        ("retokenized_exact", pa.bool_()),
    ]),
}
RECORD_TYPES = ("trajectory", "verified_success", "reward_stats")
"""What an agent publishes, i.e. what a subscription can name."""
TRAJECTORY_TYPES = ("trajectory", "verified_success")
"""Record types that become training rows of a learner (the others are side tables)."""
_WRITTEN_BY = {"rollout": "generate-rollouts", "verdict": "verify-rewards"}
_META_SCHEMA, _META_VERSION = b"hacrl.schema", b"hacrl.schema_version"


class SchemaError(DataError):
    """A record shard does not match its declared schema; the message is one line naming the file."""


def _regenerate_hint(schema: str) -> str:
    return f"regenerate it: dvc repro --force {_WRITTEN_BY.get(schema, 'exchange-and-align')}@itT"


def write_records(path: str | os.PathLike, df: pd.DataFrame, schema: str) -> None:
    """Write ``df`` as a ``schema`` shard, atomically; every field must be there with its type."""
    sch = SCHEMAS[schema]
    df = df.copy()
    df["schema_version"] = SCHEMA_VERSION
    missing = [f for f in sch.names if f not in df.columns]
    if missing:
        raise SchemaError(f"{path}: cannot write {schema} records: missing field {missing[0]!r}")
    extra = [c for c in df.columns if c not in sch.names]
    if extra:
        raise SchemaError(f"{path}: cannot write {schema} records: unexpected field {extra[0]!r}")
    try:
        table = pa.Table.from_pandas(df[sch.names], schema=sch, preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError, TypeError) as e:
        raise SchemaError(f"{path}: cannot write {schema} records: {str(e).splitlines()[0]}") from None
    table = table.replace_schema_metadata({_META_SCHEMA: schema.encode(),
                                           _META_VERSION: str(SCHEMA_VERSION).encode()})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _normal(t: pa.DataType) -> pa.DataType:
    """The type as pandas reads it back: large and small strings / lists are the same to us."""
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(_normal(t.value_type))
    return t


def _file_version(path: Path, meta: dict, table_schema: pa.Schema) -> int:
    if _META_VERSION in meta:
        return int(meta[_META_VERSION])
    if "schema_version" in table_schema.names:  # v1: a column, no file metadata
        col = pq.read_table(path, columns=["schema_version"]).column(0).unique().to_pylist()
        if len(col) == 1 and isinstance(col[0], int):
            return col[0]
    return 0


def read_records(path: str | os.PathLike, schema: str) -> pd.DataFrame:
    """Read a ``schema`` shard, checking the schema name, its version and every field's type."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: {schema} shard does not exist")
    try:
        file_schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise SchemaError(f"{path}: not a readable Parquet shard ({str(e).splitlines()[0]})") from None
    meta = file_schema.metadata or {}
    written = meta.get(_META_SCHEMA, b"").decode() or None
    if written is not None and written != schema:
        raise SchemaError(f"{path}: holds {written} records, expected {schema}")
    version = _file_version(path, meta, file_schema)
    expected = SCHEMAS[schema]
    upgrade_v1 = version == 1 and schema == "trajectory"
    if version != SCHEMA_VERSION and not upgrade_v1:
        raise SchemaError(f"{path}: unknown schema_version {version or 'missing'} for {schema} records "
                          f"(this hacrl reads version {SCHEMA_VERSION}); {_regenerate_hint(schema)}")
    for f in expected:
        if upgrade_v1 and f.name == "record_type":
            continue
        if f.name not in file_schema.names:
            raise SchemaError(f"{path}: {schema} schema v{version}: field {f.name!r} missing; "
                              f"{_regenerate_hint(schema)}")
        got = _normal(file_schema.field(f.name).type)
        if got != f.type:
            raise SchemaError(f"{path}: {schema} schema v{version}: field {f.name!r} has type {got}, "
                              f"expected {f.type}")
    df = pq.read_table(path).to_pandas()
    if written is None and "record_type" in df.columns and schema in RECORD_TYPES:
        found = set(df["record_type"]) - {schema}
        if found:  # a file without metadata: its rows must say they are of this type
            raise SchemaError(f"{path}: holds {sorted(found)[0]} records, expected {schema}")
    if upgrade_v1:
        df.insert(0, "record_type", "trajectory")
        df["schema_version"] = SCHEMA_VERSION
    return df[expected.names]


# ----------------------------------------------------------------------------- building records

def rollout_records(step: int, producer: str, tokenizer_id: str, prompts: list[dict], rendered: list[str],
                    completions: list) -> pd.DataFrame:
    """The ``rollout`` rows of one agent's completions (``hacrl.rollout.engine.Completion``)."""
    ps = [prompts[c.prompt_index] for c in completions]
    n = len(completions)
    # built column by column: a frame from one dict per row cost about as much as writing it
    cols = {
        "record_id": [f"it{step}/{producer}/{p['id']}/{c.sample_index}" for p, c in zip(ps, completions)],
        "schema_version": [SCHEMA_VERSION] * n, "step": [step] * n, "producer": [producer] * n,
        "producer_tokenizer": [tokenizer_id] * n, "prompt_id": [p["id"] for p in ps],
        "problem": [p["problem"] for p in ps], "gold": [p["answer"] for p in ps], "level": [p["level"] for p in ps],
        "rendered_prompt": [rendered[c.prompt_index] for c in completions],
        "prompt_token_ids": [c.prompt_token_ids for c in completions], "response_text": [c.text for c in completions],
        "response_token_ids": [c.token_ids for c in completions], "response_logprobs": [c.logprobs for c in completions],
        "finish_reason": [c.finish_reason for c in completions], "sample_index": [c.sample_index for c in completions],
    }
    return pd.DataFrame({k: cols[k] for k in SCHEMAS["rollout"].names})


def reward_stats(trajectories: pd.DataFrame) -> pd.DataFrame:
    """Per producer and prompt: number of rewarded samples, successes, mean and unbiased std."""
    cols = SCHEMAS["reward_stats"].names
    if trajectories.empty:
        return pd.DataFrame(columns=cols)
    g = trajectories.groupby(["producer", "prompt_id"], sort=False)["reward"]
    out = pd.DataFrame({"n": g.size(), "successes": g.apply(lambda r: int((r > 0).sum())),
                        "mean": g.mean(), "std": g.std(ddof=1).fillna(0.0)}).reset_index()
    out["record_type"] = "reward_stats"
    out["schema_version"] = SCHEMA_VERSION
    out["step"] = int(trajectories["step"].iloc[0])
    return out[cols]


def publish(rollouts: pd.DataFrame, verdicts: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """One agent's published records of the step: ``trajectory``, ``verified_success``, ``reward_stats``.

    Samples whose gold answer does not parse (reward None) carry no signal and are not published.
    ``advantage`` is the producer's own group-normalised advantage (eps 1e-6).
    """
    import torch

    from hacrl.groups import group_normalized_advantage

    df = rollouts.merge(verdicts[["record_id", "reward", "verdict"]], on="record_id", how="inner",
                        validate="one_to_one")
    if len(df) != len(rollouts):
        raise DataError(f"verdicts cover {len(df)} of {len(rollouts)} rollout records")
    df = df[df["reward"].notna()].copy()
    codes, _ = pd.factorize(df["prompt_id"])
    adv = group_normalized_advantage(torch.tensor(df["reward"].to_numpy(), dtype=torch.float32),
                                     torch.tensor(codes, dtype=torch.long), PUBLISHED_ADV_EPS)
    df["advantage"] = adv.numpy().astype("float64")
    df["record_type"] = "trajectory"
    df["schema_version"] = SCHEMA_VERSION
    traj = df[SCHEMAS["trajectory"].names].reset_index(drop=True)
    success = traj[traj["verdict"] == "correct"].assign(record_type="verified_success").reset_index(drop=True)
    return {"trajectory": traj, "verified_success": success, "reward_stats": reward_stats(traj)}


# ----------------------------------------------------------------------------- subscription

def select(published: dict[str, dict[str, pd.DataFrame]], learner: str, stream) -> pd.DataFrame:
    """The records of one subscription stream (``config.StreamConfig``) for ``learner``.

    ``published``: producer -> record type -> records, in pool order. ``stream.producers``:
    ``self``, ``peers`` or ``all``; ``stream.verdicts``: keep only these verdicts (None: all).
    """
    frames = []
    for producer, shards in published.items():
        if (stream.producers == "self") != (producer == learner) and stream.producers != "all":
            continue
        df = shards[stream.record_type]
        if stream.verdicts is not None and "verdict" in df.columns:
            df = df[df["verdict"].isin(stream.verdicts)]
        frames.append(df)
    cols = SCHEMAS[stream.record_type].names
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True)[cols] if frames else pd.DataFrame(columns=cols)


@dataclass
class LearnerView:
    """What one learner needs to see peers' records in its own tokens."""

    name: str
    tokenizer: Any
    template: str


@dataclass
class LearnerInput:
    """A learner's subscription result: training rows and side tables (e.g. ``reward_stats``)."""

    rows: pd.DataFrame
    side: dict[str, pd.DataFrame] = field(default_factory=dict)
    alignments: dict[str, list] = field(default_factory=dict)
    """Per peer producer: the THL ``Alignment`` of each of its records (residual metrics)."""
    exact: dict[str, list[bool]] = field(default_factory=dict)


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if len(xs) else 0.0


def _own_rows(records: pd.DataFrame, learner: str) -> pd.DataFrame:
    """Self rows: the generated ids and log-probs are the learner's own, on-policy."""
    own = records.copy()
    own["learner"] = learner
    own["is_self"] = True
    own["input_prompt_ids"] = own["prompt_token_ids"]
    own["input_response_ids"] = own["response_token_ids"]
    own["old_logprobs"] = own["response_logprobs"]
    own["behavior_logprob_mean"] = [_mean(x) for x in own["response_logprobs"]]
    own["behavior_logprobs_aligned"] = own["response_logprobs"]
    own["retokenized_exact"] = True
    return own


@dataclass
class Adapted:
    """A peer response in a learner's tokens."""

    ids: list[int]
    exact: bool
    alignment: Any
    """The ``thl.Alignment`` of the producer's trace onto ``ids``."""
    behavior_mean: float
    """The producer's mean generation log-prob over its own tokens (those the trace keeps)."""


def adapt_response(rec, source_tokenizer, learner_tokenizer, thl_cfg) -> Adapted:
    """THL for one record (``response_text``, ``response_token_ids``, ``response_logprobs``,
    ``finish_reason``): retokenise the text for the learner and align the producer's trace.
    ``thl_cfg.peer_eos`` decides the EOS on both sides (see ``config.ThlConfig``)."""
    from hacrl.exchange import thl

    src_ids, src_lp = list(rec.response_token_ids), list(rec.response_logprobs)
    stopped = rec.finish_reason == "stop"
    keep_eos = thl_cfg.peer_eos == "keep_if_stopped"
    if stopped and not keep_eos and src_ids and src_ids[-1] == source_tokenizer.eos_token_id:
        src_ids, src_lp = src_ids[:-1], src_lp[:-1]
    rt = thl.retokenize(learner_tokenizer, rec.response_text, append_eos=stopped and keep_eos)
    al = thl.align_response(rec.response_text, source_tokenizer, src_ids, src_lp, learner_tokenizer, rt.ids, thl_cfg)
    return Adapted(rt.ids, rt.exact, al, _mean(src_lp))


def pair_residuals(records: pd.DataFrame, source_tokenizer, learner_tokenizer, thl_cfg, limit: int) -> dict:
    """THL residual metrics of one (producer, learner) pair on the first ``limit`` records."""
    from hacrl.exchange import thl

    ads = [adapt_response(r, source_tokenizer, learner_tokenizer, thl_cfg)
           for r in records.head(limit).itertuples(index=False)]
    return thl.residual_summary([a.alignment for a in ads], [a.exact for a in ads])


def _gold_responses(peers: pd.DataFrame, learner: LearnerView, thl_cfg,
                    gold_text: Callable[[Any], str]) -> tuple[pd.DataFrame, list[list[int]], list[bool]]:
    """The oracle's peer rows (``content: gold``): each row's response is the task's gold
    completion for its problem, encoded by the learner's own tokenizer (with its EOS where THL
    keeps a stopped peer's). There is no producer trace: the producer's ids and log-probs are
    empty and ``finish_reason`` is ``gold``."""
    from hacrl.exchange import thl

    peers = peers.copy()
    texts = [gold_text(rec) for rec in peers.itertuples(index=False)]
    enc = [thl.retokenize(learner.tokenizer, x, append_eos=thl_cfg.peer_eos == "keep_if_stopped") for x in texts]
    peers["response_text"] = texts
    peers["response_token_ids"] = [[] for _ in texts]
    peers["response_logprobs"] = [[] for _ in texts]
    peers["finish_reason"] = "gold"
    return peers, [e.ids for e in enc], [e.exact for e in enc]


def _peer_rows(records: pd.DataFrame, learner: LearnerView, source_tokenizers: dict[str, Any], thl_cfg,
               out: LearnerInput, gold_text: Callable[[Any], str] | None = None) -> pd.DataFrame:
    """Peer rows in the learner's tokens (THL): retokenised text, the learner's template for the
    prompt, and the producer's log-prob trace aligned onto the learner's tokens. With
    ``gold_text``, the rows carry the gold completion instead (:func:`_gold_responses`), and the
    behaviour log-probs are NaN."""
    tok = learner.tokenizer
    peers = records.copy()
    prompt_ids = {p: tok(learner.template.replace("{problem}", text), add_special_tokens=False)["input_ids"]
                  for p, text in dict(zip(peers["prompt_id"], peers["problem"])).items()}
    if gold_text is not None:
        peers, resp_ids, exact = _gold_responses(peers, learner, thl_cfg, gold_text)
        aligned = [[float("nan")] * len(x) for x in resp_ids]
        means = [float("nan")] * len(resp_ids)
    else:
        resp_ids, exact, aligned, means = [], [], [], []
        for rec in peers.itertuples(index=False):
            ad = adapt_response(rec, source_tokenizers[rec.producer], tok, thl_cfg)
            out.alignments.setdefault(rec.producer, []).append(ad.alignment)
            out.exact.setdefault(rec.producer, []).append(ad.exact)
            resp_ids.append(ad.ids)
            exact.append(ad.exact)
            aligned.append(ad.alignment.aligned)
            means.append(ad.behavior_mean)
    peers["learner"] = learner.name
    peers["is_self"] = False
    peers["input_prompt_ids"] = [prompt_ids[p] for p in peers["prompt_id"]]
    peers["input_response_ids"] = resp_ids
    peers["old_logprobs"] = [[] for _ in range(len(peers))]  # the learner's snapshot is recomputed
    peers["behavior_logprob_mean"] = means
    peers["behavior_logprobs_aligned"] = aligned
    peers["retokenized_exact"] = exact
    return peers[[len(x) > 0 for x in peers["input_response_ids"]]]


def subscribe(published: dict[str, dict[str, pd.DataFrame]], learner: LearnerView, subscription: list,
              source_tokenizers: dict[str, Any], thl_cfg, gold_text: Callable[[Any], str] | None = None) -> LearnerInput:
    """A learner's input from the published records, one stream at a time in declared order.

    Trajectory-shaped streams become training rows (own records as generated; peers' through
    THL; peer responses that retokenise to nothing are dropped); other record types become side
    tables. Deterministic in the published shards, the learner's tokenizer and template. A stream
    with ``content: gold`` needs ``gold_text`` (a record -> the task's gold completion).
    """
    out = LearnerInput(rows=pd.DataFrame(columns=SCHEMAS["learner_input"].names))
    frames = []
    for stream in subscription:
        recs = select(published, learner.name, stream)
        if stream.record_type not in TRAJECTORY_TYPES:
            prev = out.side.get(stream.record_type)
            out.side[stream.record_type] = recs if prev is None else pd.concat([prev, recs], ignore_index=True)
            continue
        own = recs[recs["producer"] == learner.name]
        peers = recs[recs["producer"] != learner.name]
        if len(own):
            frames.append(_own_rows(own, learner.name))
        if len(peers):
            gold = stream.content == "gold"
            if gold and gold_text is None:
                raise ValueError("a content: gold stream needs the task's gold completions (gold_text)")
            frames.append(_peer_rows(peers, learner, source_tokenizers, thl_cfg, out, gold_text if gold else None))
    if frames:
        out.rows = pd.concat(frames, ignore_index=True)[SCHEMAS["learner_input"].names]
    return out
