"""The engine host without vLLM: one host per workspace, and the verifier workers it lends.

A stage's ``VerifierPool`` takes its workers from the host's stock (started, math-verify
imported, before the stage asked) and gets the same verdicts as with workers of its own; the
host restocks once the pool is done, and reaps the workers it lent.
"""

from __future__ import annotations

import os
import time

from hacrl.rollout import engine_host
from hacrl.task.rewards import VerifierPool

PAIRS = [("1/2", "\\boxed{\\frac{1}{2}}"), ("0.5", "\\boxed{\\frac{2}{4}}"), ("3", "\\boxed{4}"),
         ("x+1", "\\boxed{1+x}")] + [(f"{i}/7", f"\\boxed{{\\frac{{{2 * i}}}{{14}}}}") for i in range(60)]


def test_two_workspaces_never_share_a_host(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    os.symlink(a, tmp_path / "a-link")
    assert engine_host.socket_path(a) != engine_host.socket_path(b)
    assert engine_host.socket_path(tmp_path / "a-link") == engine_host.socket_path(a)  # by real path


def test_verifier_workers_lent_by_the_host_give_the_same_verdicts(tmp_path):
    with VerifierPool(2, 5.0, fast_path=False) as own:
        expected = own.verify(PAIRS)
    assert expected[:4] == ["correct", "correct", "wrong", "correct"]
    try:
        lease = engine_host.VerifierLease(tmp_path)
        with VerifierPool(2, 5.0, fast_path=False, lease=lease) as pool:
            assert pool.verify(PAIRS) == expected
        assert lease.lent == 2 and not lease.failed  # one per worker the pool started
        host = engine_host.status(tmp_path)
        assert host is not None and host["pid"] != os.getpid()
        # restocked when the pool closed its lease: the next pool's workers are ready at once
        time.sleep(3.0)
        lease2 = engine_host.VerifierLease(tmp_path)
        t0 = time.monotonic()
        with VerifierPool(2, 5.0, fast_path=False, lease=lease2) as pool:
            assert pool.verify(PAIRS) == expected
        assert lease2.lent == 2
        assert time.monotonic() - t0 < 2.0
    finally:
        assert engine_host.stop(tmp_path)
