import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import RankPool  # noqa: E402


@pytest.fixture(scope="module")
def ranks():
    """``ranks(n)`` -> a RankPool of n gloo ranks, spawned once per test module."""
    pools: dict[int, RankPool] = {}

    def get(n: int) -> RankPool:
        if n not in pools or pools[n].broken:
            pools[n] = RankPool(n)
        return pools[n]

    yield get
    for p in pools.values():
        p.close()
