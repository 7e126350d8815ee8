"""Timing, memory and reporting shared by the benchmark suites.

A contender is a callable that does the suite's work once and returns how many units it did
(tokens, samples, answers); :func:`compare` runs every contender once to warm up, then
``reps`` interleaved rounds, sampling the RSS of the process and its children meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class RssSampler:
    """Peak resident memory of this process plus its descendants while the block runs (MiB).

    Sampled every ``interval`` seconds with psutil; a child that lives shorter than the interval
    may be missed, so peaks of short subprocess bursts are lower bounds.
    """

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> float:
        import psutil

        me = psutil.Process()
        total = 0
        for p in [me, *me.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total / 2**20

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, self._sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self.peak_mib = self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_mib = max(self.peak_mib, self._sample())


@dataclass
class Contender:
    """One way of doing the suite's work. ``fn()`` does it once and returns the units done
    (a number, or a dict with ``units`` plus figures worth reporting, e.g. a logged gap)."""

    name: str
    fn: Callable[..., Any]
    note: str = ""
    setup: Callable[[], Any] | None = None
    """Run before each call, untimed; its return value is ``fn``'s argument (e.g. a freshly
    loaded model that ``fn`` trains)."""


@dataclass
class Measured:
    name: str
    note: str
    seconds: list[float]
    units: float
    peak_rss_mib: float
    extra: dict = field(default_factory=dict)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def rate(self) -> float:
        """Units per second at the median time."""
        return self.units / self.median_s if self.median_s > 0 else float("nan")

    def to_dict(self) -> dict:
        s = sorted(self.seconds)
        return {"note": self.note, "seconds": [round(x, 4) for x in self.seconds],
                "median_s": round(self.median_s, 4), "min_s": round(s[0], 4), "max_s": round(s[-1], 4),
                "units": self.units, "units_per_s": round(self.rate, 3),
                "peak_rss_mib": round(self.peak_rss_mib, 1), **({"extra": self.extra} if self.extra else {})}


@dataclass
class Goal:
    """``kind`` ``ratio``: ``contender``'s throughput over ``baseline``'s must be >= ``target``;
    ``added_s``: its median time may exceed ``baseline``'s by at most ``target`` seconds;
    ``max_s``: its median time must be <= ``target`` seconds (``baseline`` unused);
    ``max_mib``: its figure ``above_model_and_optimizer_mib`` must be <= ``target`` MiB;
    ``growth``: its peak RSS over ``baseline``'s must be <= ``target``."""

    contender: str
    baseline: str
    target: float
    kind: str = "ratio"

    def value(self, res: "SuiteResult") -> float:
        c = res.measured[self.contender]
        if self.kind == "ratio":
            return res.ratio(self.contender, self.baseline)
        if self.kind == "added_s":
            return c.median_s - res.measured[self.baseline].median_s
        if self.kind == "max_mib":
            return float(c.extra["above_model_and_optimizer_mib"])
        if self.kind == "growth":
            return c.peak_rss_mib / res.measured[self.baseline].peak_rss_mib
        return c.median_s

    def met(self, res: "SuiteResult") -> bool:
        v = self.value(res)
        return v >= self.target if self.kind == "ratio" else v <= self.target

    def describe(self) -> str:
        if self.kind == "ratio":
            return f"{self.contender} / {self.baseline} >= {self.target:.3g}x"
        if self.kind == "added_s":
            return f"{self.contender} - {self.baseline} <= {self.target} s"
        if self.kind == "max_mib":
            return f"{self.contender}: peak above model and optimizer <= {self.target:.0f} MiB"
        if self.kind == "growth":
            return f"{self.contender} peak RSS / {self.baseline}'s <= {self.target}x"
        return f"{self.contender} <= {self.target} s"

    def unit(self) -> str:
        return {"ratio": "x", "growth": "x", "max_mib": " MiB"}.get(self.kind, " s")


@dataclass
class SuiteResult:
    suite: str
    unit: str
    work: dict
    measured: dict[str, Measured]
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    size: str = "full"
    reps: int = 0
    baseline: str | None = None
    """The contender the table's ratio column divides by (default: the last one)."""

    def ratio(self, a: str, b: str) -> float:
        return self.measured[a].rate / self.measured[b].rate

    def to_dict(self) -> dict:
        names = list(self.measured)
        ratios = {f"{a}/{b}": round(self.ratio(a, b), 3) for i, a in enumerate(names) for b in names[i + 1:]}
        return {"suite": self.suite, "size": self.size, "reps": self.reps, "unit": self.unit,
                "machine": machine(), "work": self.work,
                "contenders": {k: v.to_dict() for k, v in self.measured.items()},
                "ratios": ratios,
                "goals": [{**asdict(g), "value": round(g.value(self), 3), "met": g.met(self)} for g in self.goals],
                "notes": self.notes}


def machine() -> dict:
    """What the ratios were measured on (no host name, no path)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    try:
        txt = Path("/proc/cpuinfo").read_text()
        flags = "avx512" if "avx512f" in txt else "avx2" if "avx2" in txt else ""
    except OSError:
        pass
    import torch

    return {"cpu": cpu, "simd": flags, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def as_stage_process(fn: Callable[[], Any]) -> Any:
    """``fn()`` as ``hacrl stage`` runs a stage under ``dvc repro`` or Prefect: its engine
    processes and verifier workers are the workspace engine host's."""
    from hacrl.pipeline.stage_engines import serve_from_host

    serve_from_host(True)
    try:
        return fn()
    finally:
        serve_from_host(False)


def compare(contenders: list[Contender], reps: int, warmup: bool = True) -> dict[str, Measured]:
    """Warm each contender up once, then run ``reps`` interleaved rounds; return the figures."""
    secs: dict[str, list[float]] = {c.name: [] for c in contenders}
    units: dict[str, float] = {}
    extra: dict[str, dict] = {c.name: {} for c in contenders}
    peak: dict[str, float] = dict.fromkeys(secs, 0.0)

    def once(c: Contender) -> float:
        arg = c.setup() if c.setup is not None else None
        with RssSampler() as rss:
            t0 = time.perf_counter()
            out = c.fn(arg) if c.setup is not None else c.fn()
            dt = time.perf_counter() - t0
        del arg
        peak[c.name] = max(peak[c.name], rss.peak_mib)
        if isinstance(out, dict):
            u = float(out.pop("units"))
            extra[c.name].update(out)
        else:
            u = float(out)
        if c.name in units and units[c.name] != u:
            log.warning("%s did %s units in one round and %s in another", c.name, units[c.name], u)
        units[c.name] = u
        return dt

    if warmup:
        for c in contenders:
            log.info("warm-up: %s", c.name)
            once(c)
        extra = {c.name: {} for c in contenders}  # the measured rounds' figures, not the warm-up's
    for r in range(reps):
        for c in contenders:
            dt = once(c)
            secs[c.name].append(dt)
            log.info("round %d/%d %-24s %.3f s", r + 1, reps, c.name, dt)
    return {c.name: Measured(c.name, c.note, secs[c.name], units[c.name], peak[c.name], extra[c.name])
            for c in contenders}


def table(res: SuiteResult) -> str:
    """A markdown table of the suite (also what the terminal shows)."""
    names = list(res.measured)
    base = res.baseline or names[-1]
    lines = [f"## {res.suite} ({res.size}, {res.reps} rounds after a warm-up)", "",
             "Work: " + ", ".join(f"{k}={v}" for k, v in res.work.items()), "",
             f"| contender | median s | min-max s | {res.unit}/s | vs {base} | peak RSS MiB |",
             "|---|---|---|---|---|---|"]
    for n in names:
        m = res.measured[n]
        lines.append(f"| {n} | {m.median_s:.3f} | {min(m.seconds):.3f}-{max(m.seconds):.3f} | {m.rate:.1f} | "
                     f"{res.ratio(n, base):.2f}x | {m.peak_rss_mib:.0f} |")
    if res.goals:
        lines += ["", "| goal | measured | met |", "|---|---|---|"]
        for g in res.goals:
            v = g.value(res)
            lines.append(f"| {g.describe()} | {v:.2f}{g.unit()} | "
                         f"{'yes' if g.met(res) else 'NO'} |")
    notes = [f"- {res.measured[n].name}: {res.measured[n].note}" for n in names if res.measured[n].note] + \
            [f"- {x}" for x in res.notes]
    for n in names:
        if res.measured[n].extra:
            notes.append(f"- {n}: " + ", ".join(f"{k}={v}" for k, v in res.measured[n].extra.items()))
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def write(res: SuiteResult, out_dir: Path) -> Path:
    """``out_dir/SUITE.json`` and ``.md``, each written to a temporary name and renamed."""
    from hacrl.storage import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / f"{res.suite}.json", json.dumps(res.to_dict(), indent=2) + "\n")
    atomic_write_text(out_dir / f"{res.suite}.md", table(res))
    return out_dir / f"{res.suite}.json"
