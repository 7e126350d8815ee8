import time

import pytest

from hacrl.task.rewards import (CORRECT, GOLD_UNPARSEABLE, NO_ANSWER, TIMEOUT, WRONG, VerifierPool, verdict,
                                fast_verdict, reward_of)


@pytest.mark.parametrize("gold, response, expected", [
    ("82", "Q: ... A: \\boxed{82}", CORRECT),
    ("82", "\\boxed{83}", WRONG),
    ("\\frac{1}{2}", "\\boxed{0.5}", CORRECT),
    ("42", "\\boxed{42.0}", CORRECT),
    ("7", "I do not know", NO_ANSWER),
    ("}{", "\\boxed{3}", GOLD_UNPARSEABLE),
    ("\\frac{", "\\boxed{3}", GOLD_UNPARSEABLE),  # malformed LaTeX: only math-verify's fallback string
    ("12\\%", "\\boxed{12\\%}", CORRECT),  # a text gold keeps math-verify's string comparison
    ("12\\%", "\\boxed{13\\%}", WRONG),
])
def test_verdicts(gold, response, expected):
    assert verdict(gold, response) == expected


def test_rewards_are_binary_and_unparseable_gold_is_skipped():
    assert reward_of(CORRECT) == 1.0 and reward_of(WRONG) == 0.0 and reward_of(TIMEOUT) == 0.0
    assert reward_of(GOLD_UNPARSEABLE) is None


def test_pool_verifies_in_order_and_dedupes():
    pairs = [("4", "\\boxed{4}"), ("4", "\\boxed{5}"), ("4", "\\boxed{4}"), ("9", "nothing")]
    with VerifierPool(2, 5.0) as pool:
        assert pool.verify(pairs) == [CORRECT, WRONG, CORRECT, NO_ANSWER]
        assert pool.killed == 0


# A stand-in for what SIGALRM cannot interrupt (C-level bignum work): a worker that never
# answers one specific response. The real math-verify worker answers everything else.
HANGING_WORKER = (
    "import sys, json, time\n"
    "from hacrl.task.rewards import verdict\n"
    "for line in sys.stdin:\n"
    "    k, g, r = json.loads(line)\n"
    "    if r == 'HANG':\n"
    "        time.sleep(3600)\n"
    "    sys.stdout.write(json.dumps([k, verdict(g, r)]) + '\\n'); sys.stdout.flush()\n"
)


def test_a_hung_check_is_killed_not_waited_on():
    pairs = [("1", "HANG"), ("4", "\\boxed{4}"), ("2", "HANG"), ("5", "\\boxed{6}")]
    t0 = time.monotonic()
    with VerifierPool(2, 1.0, worker_code=HANGING_WORKER) as pool:
        out = pool.verify(pairs)
        killed = pool.killed
    assert out == [TIMEOUT, CORRECT, TIMEOUT, WRONG]
    assert killed == 2
    assert time.monotonic() - t0 < 20


# ----------------------------------------------------------------------------- pipelined pool

def _real_worker(trigger: str, action: str, ready_delay: float = 0.0, ready_file: str = "") -> str:
    """A worker running the real ``verdict`` that does ``action`` on the response ``trigger``;
    it says it is ready ``ready_delay`` s after its imports (noting when in ``ready_file``)."""
    return (
        "import sys, json, os, time\n"
        "from hacrl.task.rewards import verdict\n"
        "import math_verify\n"
        f"time.sleep({ready_delay})\n"
        f"if {ready_file!r}:\n"
        f"    open({ready_file!r}, 'a').write(repr(time.monotonic()) + '\\n')\n"
        "sys.stdout.write(json.dumps('ready') + '\\n'); sys.stdout.flush()\n"
        "for line in sys.stdin:\n"
        "    k, g, r = json.loads(line)\n"
        f"    if r == {trigger!r}:\n"
        f"        {action}\n"
        "    sys.stdout.write(json.dumps([k, verdict(g, r)]) + '\\n'); sys.stdout.flush()\n"
    )


def test_a_hung_check_is_killed_one_second_after_its_timeout_counted_from_ready(tmp_path):
    # the worker takes 1.5 s more to get ready; a clock started when the answer was sent would
    # kill it 2 s after that, before it even began
    ready = tmp_path / "ready"
    code = _real_worker("HANG", "time.sleep(3600)", ready_delay=1.5, ready_file=str(ready))
    with VerifierPool(1, 1.0, worker_code=code, announces_ready=True) as pool:
        t0 = time.monotonic()
        assert pool.verify([("1", "HANG")]) == [TIMEOUT]
        killed_at = time.monotonic()
        assert pool.hard_limit == 2.0 and pool.killed == 1
    assert killed_at - t0 > 2.0 + 1.5 - 0.05
    first_ready = float(ready.read_text().split()[0])  # its replacement notes its own later
    assert 2.0 - 0.05 <= killed_at - first_ready < 2.0 + 0.3


def test_the_other_outstanding_answers_of_a_killed_worker_are_requeued():
    # one worker, so every answer is in its pipeline when the first hang is killed
    pairs = [("4", "\\boxed{4}"), ("1", "HANG"), ("\\frac{1}{2}", "\\boxed{0.5}"), ("2", "HANG"),
             ("5", "\\boxed{6}"), ("7", "nothing here"), ("4", "\\boxed{4}")]
    with VerifierPool(1, 1.0, worker_code=_real_worker("HANG", "time.sleep(3600)"), announces_ready=True) as pool:
        assert pool.depth >= len(set(pairs))
        out = pool.verify(pairs)
        # all six distinct answers were sent at once; four waited behind the first hang, two behind the second
        assert (pool.killed, pool.requeued) == (2, 6)
    assert out == [CORRECT, TIMEOUT, CORRECT, TIMEOUT, WRONG, NO_ANSWER, CORRECT]


def test_a_worker_that_dies_mid_pipeline_times_out_that_answer_only():
    pairs = [("4", "\\boxed{4}"), ("1", "DIE"), ("5", "\\boxed{6}"), ("3", "\\boxed{3}")]
    with VerifierPool(2, 5.0, worker_code=_real_worker("DIE", "os._exit(1)"), announces_ready=True) as pool:
        assert pool.verify(pairs) == [CORRECT, TIMEOUT, WRONG, CORRECT]
        assert pool.killed == 1


def test_a_worker_that_cannot_start_is_an_error_not_a_timeout():
    with VerifierPool(1, 1.0, worker_code="import sys; sys.exit(3)", announces_ready=True) as pool:
        with pytest.raises(RuntimeError, match="before it was ready"):
            pool.verify([("4", "\\boxed{4}")])


def test_the_real_worker_announces_ready_and_the_pool_closes_at_once():
    pairs = [(str(i), f"\\boxed{{{i + i % 2}}}") for i in range(40)]
    with VerifierPool(2, 5.0, fast_path=False) as pool:
        assert pool.announces_ready
        assert pool.verify(pairs) == [verdict(g, r) for g, r in pairs]
        assert pool.fast == 0 and len(pool.workers) == 2
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 1.0


def test_a_worker_that_died_idle_is_replaced():
    import select

    with VerifierPool(1, 5.0, fast_path=False) as pool:
        pool.start()
        w = pool.workers[0]
        assert select.select([w.fd], [], [], 60)[0]  # it said it is ready; nobody has read that yet
        w.proc.kill()
        w.proc.wait()
        assert pool.verify([("4", "\\boxed{4}"), ("4", "\\boxed{5}")]) == [CORRECT, WRONG]
        assert pool.killed == 1


def test_parsed_golds_are_reused_only_when_their_latex_converted():
    golds: dict = {}
    pairs = [("\\frac{1}{2}", "\\boxed{0.5}"), ("\\frac{1}{2}", "\\boxed{2}"), ("}{", "\\boxed{3}"),
             ("\\frac{", "\\boxed{3}"), ("\\frac{1}{2}", "1/2")]
    assert [verdict(g, r, 5.0, golds) for g, r in pairs] == [verdict(g, r) for g, r in pairs]
    # "}{" parses to nothing and "\frac{" only to its fallback string: neither is kept
    assert list(golds) == ["\\frac{1}{2}"]


# ----------------------------------------------------------------------------- fast path

def _integer_pairs() -> list[tuple[str, str]]:
    """Canonical integers against boxed canonical integers: equal, off by one, scaled by 10 and
    100 both ways (math-verify's percentage handling), negated, zero, and 12-digit ones."""
    import random

    rng = random.Random(0)
    ns = [0, 1, 2, 5, 9, 10, 99, 100, 101, 154, 999, 1000, 123456, 10**11, 999999999999]
    ns += [rng.randrange(-10**6, 10**6) for _ in range(60)] + [rng.randrange(10**11, 10**12) for _ in range(20)]
    pairs = []
    for n in ns:
        for m in {n, n + 1, n - 1, -n, n * 10, n * 100, n // 10, n // 100, 0, 1}:
            if abs(m) < 10**12:
                pairs.append((str(n), f"\\boxed{{{m}}}"))
    pairs += [("7", " \\boxed{7} "), ("7", "\\boxed{7}\n"), ("-3", "\\boxed{-3}")]
    return pairs


def test_the_fast_path_gives_math_verifys_verdict_on_every_pair_it_decides():
    pairs = _integer_pairs()
    decided = [(g, r, fast_verdict(g, r)) for g, r in pairs]
    assert all(v is not None for _, _, v in decided)
    assert {v for _, _, v in decided} == {CORRECT, WRONG}
    golds: dict = {}
    assert [v for _, _, v in decided] == [verdict(g, r, 5.0, golds) for g, r, _ in decided]


@pytest.mark.parametrize("gold, response", [
    ("007", "\\boxed{7}"), ("7", "\\boxed{007}"), ("0", "\\boxed{-0}"), ("-0", "\\boxed{0}"),
    ("1234567890123", "\\boxed{1234567890123}"), ("7", "\\boxed{ 7}"), ("7", "\\boxed{7} or \\boxed{8}"),
    ("7", "The answer is \\boxed{7}"), ("7", "\\boxed{7.0}"), ("7", "$\\boxed{7}$"), ("7.5", "\\boxed{7.5}"),
    ("\\frac{1}{2}", "\\boxed{1}"), (" 7", "\\boxed{7}"), ("+7", "\\boxed{7}"), ("7", "\\boxed{+7}"),
])
def test_the_fast_path_leaves_everything_else_to_math_verify(gold, response):
    assert fast_verdict(gold, response) is None


def test_a_pool_the_fast_path_settles_starts_no_worker_and_the_rest_go_to_math_verify():
    pairs = [("4", "\\boxed{4}"), ("4", "\\boxed{5}"), ("4", "\\boxed{4}")]
    with VerifierPool(2, 5.0) as pool:
        assert pool.verify(pairs) == [CORRECT, WRONG, CORRECT]
        assert pool.fast == 2 and pool.workers == []
        mixed = pairs + [("\\frac{1}{2}", "\\boxed{0.5}"), ("9", "nothing")]
        assert pool.verify(mixed) == [CORRECT, WRONG, CORRECT, CORRECT, NO_ANSWER]
        assert pool.fast == 4 and len(pool.workers) == 1  # two answers to check: one worker
    with VerifierPool(1, 5.0, fast_path=False) as pool:
        assert pool.verify(pairs) == [CORRECT, WRONG, CORRECT]
        assert pool.fast == 0 and len(pool.workers) == 1


def test_math_verifys_own_timeouts_are_timeouts_and_a_gold_that_does_not_parse_is_skipped():
    """math-verify catches its own alarms and returns "nothing parsed" / "not equal", saying so
    only in a warning; those checks are `timeout` (not `wrong`), in-process and in the workers.
    A gold answer with no LaTeX meaning is `gold_unparseable`, whose reward skips the sample."""
    tower = r"\boxed{9^{9^{9^{9}}}}"  # sympy cannot settle 5 == this within the 1 s alarm
    assert verdict("5", tower, 1.0) == "timeout"
    assert verdict("\\frac{", r"\boxed{5}", 1.0) == "gold_unparseable" and reward_of("gold_unparseable") is None
    assert verdict("5", r"\boxed{5}", 1.0) == "correct" and verdict("5", r"\boxed{6}", 1.0) == "wrong"
    with VerifierPool(workers=1, timeout_s=1.0, fast_path=False) as pool:
        assert pool.verify([("5", tower), ("\\frac{", r"\boxed{5}"), ("5", r"\boxed{5}"), ("7", "no number")]) == \
            ["timeout", "gold_unparseable", "correct", "no_answer"]
