"""The replicated fast tier's single-process parts (issue 28): settings checked before
any collective can hang, places, the free-space warning, and the start-up sweep of
what a killed transfer left."""
from __future__ import annotations

import logging
import os
import socket
from types import SimpleNamespace

import pytest

from dckpt.errors import CheckpointError
from dckpt.protocol.collectives import Comm
from dckpt.tiers.peers import part as peerpart, replication


def test_settings_default_node_is_the_host_and_bad_values_are_named():
    a = replication.agree_settings(Comm(), 1, None)
    assert a.replicas == 1 and dict(a.nodes) == {0: socket.gethostname()}
    assert dict(replication.agree_settings(Comm(), 0, 3).nodes) == {0: "3"}
    for bad, what in ((-1, "replicas must be an int >= 0, not -1"),
                      (True, "replicas must be an int >= 0, not True"),
                      ("1", "replicas must be an int >= 0, not '1'")):
        with pytest.raises(CheckpointError, match=f"rank 0: {what}"):
            replication.agree_settings(Comm(), bad, None)
    with pytest.raises(CheckpointError, match="rank 0: node must be a non-empty str or int"):
        replication.agree_settings(Comm(), 1, "")


def test_manager_refuses_replicas_without_local_root(tmp_path):
    import dckpt

    with pytest.raises(CheckpointError, match="replicas=1 needs local_root"):
        dckpt.CheckpointManager(str(tmp_path / "ck"), replicas=1)


def test_places_group_ranks_sharing_a_directory():
    nodes = {0: "a", 1: "a", 2: "b", 3: "b"}
    got = replication.places(nodes, [0, 0, 2, 3])  # each rank's lowest sharer
    assert got == {0: "a#0", 1: "a#0", 2: "b#2", 3: "b#3"}
    assert replication.node_of("host#7#12") == "host#7"


def test_free_space_warning_once(tmp_path, monkeypatch, caplog):
    rep = replication.Replicator.__new__(replication.Replicator)
    rep.root, rep.replicas, rep._warned_space = str(tmp_path), 1, False
    rep.comm = SimpleNamespace(rank=0)
    rep.place_of = {0: "a#0", 1: "a#0", 2: "b#2", 3: "b#2"}
    commit = SimpleNamespace(total_bytes=8 << 30)  # 8 GiB step: 4 GiB per node, x2
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(
        f_bavail=(3 << 30) // 4096, f_frsize=4096) if p == str(tmp_path) else real(p))
    with caplog.at_level(logging.WARNING, "dckpt.tiers.peers.replication"):
        rep._check_space(commit)
        rep._check_space(commit)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "has 3.0 GiB free" in msgs[0] and "need about 8.0 GiB" in msgs[0]


def test_sweep_removes_what_killed_transfers_left(tmp_path):
    d = tmp_path / "peers" / "step-00000010"
    (d / ".incoming").mkdir(parents=True)
    (d / ".incoming" / "manifest-00001.json").write_text("{}")
    (d / ".data-x-00001.safetensors.peer-abc.tmp").write_bytes(b"x")
    (d / "data-0123456789abcdef-00001.safetensors").write_bytes(b"kept")
    (tmp_path / ".restore-step-00000010-00003").mkdir()
    assert peerpart.sweep(str(tmp_path)) == 3
    left = sorted(os.path.relpath(os.path.join(b, n), tmp_path)
                  for b, _, fs in os.walk(tmp_path) for n in fs)
    assert left == ["peers/step-00000010/data-0123456789abcdef-00001.safetensors"]


def test_one_process_with_replicas_warns_and_goes_on(tmp_path, caplog):
    import torch

    import dckpt

    with caplog.at_level(logging.WARNING, "dckpt.tiers.fast"):
        mgr = dckpt.CheckpointManager(str(tmp_path / "ck"), local_root=str(tmp_path / "fast"),
                                      replicas=1, every_steps=1)
    assert any("no other node to replicate to" in r.getMessage() for r in caplog.records)
    mgr.save(1, {"w": torch.ones(3)})
    mgr.close()
    st = {"w": torch.zeros(3)}
    mgr = dckpt.CheckpointManager(str(tmp_path / "ck"), local_root=str(tmp_path / "fast"),
                                  replicas=1)
    assert mgr.restore(st) == 1 and mgr.restored_from == "local"
    assert torch.equal(st["w"], torch.ones(3))
    mgr.close()


def _verdict(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:
        return type(e).__name__


def test_stream_check_agrees_with_verify_shard_on_any_split_and_any_flip(tmp_path):
    import random

    import torch

    import dckpt
    from dckpt.storage.local import LocalStorage
    from dckpt.tiers.peers.xfer import StreamCheck, verify_shard

    dckpt.save({"w": torch.arange(300_000, dtype=torch.float32), "e": torch.empty(0),
                "b": torch.ones(7, dtype=torch.int64)}, str(tmp_path / "ck"))
    path = str(next((tmp_path / "ck").glob("data-*")))
    good = open(path, "rb").read()
    rng = random.Random(3)

    def streamed(data: bytes) -> None:
        c = StreamCheck(path, len(data))
        pos = 0
        while pos < len(data):
            n = rng.choice([1, 7, 4096, 100_000, 1 << 20])
            c.feed(memoryview(data)[pos:pos + n], pos)
            pos += n
        c.finish()

    for _ in range(5):
        streamed(good)
    hlen = int.from_bytes(good[:8], "little")
    for at in [0, 3, 9, hlen + 7, hlen + 8, hlen + 9, len(good) - 1] + \
            [rng.randrange(len(good)) for _ in range(40)]:
        bad = bytearray(good)
        bad[at] ^= 0x10
        with open(path, "wb") as f:
            f.write(bad)
        want = _verdict(lambda: verify_shard(LocalStorage(), path))
        assert _verdict(lambda: streamed(bytes(bad))) == want, at
        if at >= 8 + hlen:  # a flip in the data is always caught
            assert want == "IntegrityError"
    with pytest.raises(Exception, match="shorter than its header"):
        StreamCheck(path, len(good)).finish()


def _replicator(root, keep: int, replicated):
    from dckpt.catalog.retention import RetentionPolicy
    from dckpt.storage.local import LocalStorage

    rep = replication.Replicator.__new__(replication.Replicator)
    rep.root, rep.storage, rep.retention = str(root), LocalStorage(), RetentionPolicy(keep)
    rep.replicated = replicated
    return rep


def test_old_replicas_go_whether_or_not_the_newest_copy_succeeded(tmp_path):
    """Issue 34 (1.6, 1.7): peers/ keeps keep_last_local steps up to the newest
    replicated one plus the step just tried, counting steps with no replica here."""
    for s in (10, 20, 30, 40):
        (tmp_path / "peers" / f"step-{s:08d}" / ".incoming").mkdir(parents=True)
        (tmp_path / f"step-{s:08d}").mkdir()
    rep = _replicator(tmp_path, 1, 10)
    rep._drop_old_replicas(40)  # 20, 30, 40 failed: 10 is still the newest replicated
    assert peerpart.peer_steps(str(tmp_path)) == [10, 40]
    rep.replicated = 50  # replicated, but no node sends here any more (a shrink)
    (tmp_path / "step-00000050").mkdir()
    rep._drop_old_replicas(50)
    assert peerpart.peer_steps(str(tmp_path)) == []


def test_reclaim_removes_every_replica_once_by_the_lowest_sharer(tmp_path):
    for s in (10, 20):
        (tmp_path / "peers" / f"step-{s:08d}").mkdir(parents=True)
        (tmp_path / "peers" / f"step-{s:08d}" / "manifest-00002.json").write_text("{}")
    assert replication.reclaim(str(tmp_path), {0, 1}, 1) == 0  # not the lowest sharer
    assert peerpart.peer_steps(str(tmp_path)) == [10, 20]
    assert replication.reclaim(str(tmp_path), {0, 1}, 0) == 2
    assert not (tmp_path / "peers").exists()
    assert replication.reclaim(str(tmp_path), None, 3) == 0  # nothing left: a no-op
