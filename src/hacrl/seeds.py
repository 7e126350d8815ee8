"""Stable seeds from names: the same experiment seed, stage, iteration and agent give the same
seed on every machine and in every process (Python's ``hash`` is salted per process)."""

from __future__ import annotations

import random


def hash_seed(*parts) -> int:
    """A seed in [0, 2**31 - 1) from the master seed and names (stage, iteration, agent)."""
    return random.Random("/".join(map(str, parts))).randrange(2**31 - 1)
