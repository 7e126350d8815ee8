import time

import pytest

from hacrl.rewards import (CORRECT, GOLD_UNPARSEABLE, NO_ANSWER, TIMEOUT, WRONG, VerifierPool,
                           check, reward_of)


@pytest.mark.parametrize("gold, response, verdict", [
    ("82", "Q: ... A: \\boxed{82}", CORRECT),
    ("82", "\\boxed{83}", WRONG),
    ("\\frac{1}{2}", "\\boxed{0.5}", CORRECT),
    ("42", "\\boxed{42.0}", CORRECT),
    ("7", "I do not know", NO_ANSWER),
    ("}{", "\\boxed{3}", GOLD_UNPARSEABLE),
])
def test_check_verdicts(gold, response, verdict):
    assert check(gold, response) == verdict


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
    "from hacrl.rewards import check\n"
    "for line in sys.stdin:\n"
    "    k, g, r = json.loads(line)\n"
    "    if r == 'HANG':\n"
    "        time.sleep(3600)\n"
    "    sys.stdout.write(json.dumps([k, check(g, r)]) + '\\n'); sys.stdout.flush()\n"
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
