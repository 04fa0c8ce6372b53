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


@pytest.fixture(scope="session")
def s3():
    """A real S3-compatible server (moto's, on loopback) for this test session, or a
    skip where the s3 extra is not installed (.ci/run installs it)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from s3server import S3Server

    server = S3Server().start()
    yield server
    server.stop()
