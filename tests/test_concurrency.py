"""Concurrent writers and gc during a save, on every storage backend (conformance).

Two saves to one path run in two threads of one process (the memory file system is
per process; on local disk two processes would race the same way). Each save is held
at a chosen point of its protocol through the fault-injection hook, so the races are
deterministic: both plans checked before either commit, a commit in the middle of the
other's write, gc while the files are written but not yet committed.
"""
from __future__ import annotations

import os
import threading
import uuid

import pytest
import torch

import dckpt
from dckpt import _faults
from dckpt.catalog.gc import collect_garbage
from dckpt.storage.fsspec_storage import make_storage
from dckpt.catalog.verify import verify_checkpoint


@pytest.fixture(params=["local-direct", "local-buffered", "memory", "s3"])
def where(request, tmp_path):
    """(checkpoint path or URL, storage_options) on each backend ("s3": a real
    S3-compatible server on loopback, where the exclusive commit is a conditional PUT)."""
    if request.param == "s3":
        server = request.getfixturevalue("s3")
        yield server.url("concurrency") + "/ckpt", server.options
        return
    if request.param == "memory":
        url = f"memory://concurrency-{uuid.uuid4().hex}"
        yield url + "/ckpt", None
        s, root = make_storage(url)
        if s.exists(root):
            s.remove_tree(root)
        return
    yield str(tmp_path / "ckpt"), {"direct_io": request.param == "local-direct"}


def _state(gen: int) -> dict:
    return {"w": torch.full((64, 16), float(gen)), "b": torch.arange(8) + gen, "gen": gen}


def _loads_as(path: str, opts, gen: int) -> None:
    t = _state(-1)
    dckpt.load(t, path, storage_options=opts)
    assert t["gen"] == gen and torch.equal(t["w"], _state(gen)["w"])
    report = verify_checkpoint(path, opts)
    assert report.ok, report.problems


def _names(path: str, opts) -> list[str]:
    s, root = make_storage(path, opts)
    return sorted(e.name for e in s.listdir(root))


class _Gate:
    """Holds named threads at fault points: ``hold(thread_name, point)`` returns an
    event that the thread waits on when it reaches ``point``, and an event set when it
    has arrived there."""

    def __init__(self, monkeypatch) -> None:
        self.waits: dict[tuple[str, str], tuple[threading.Event, threading.Event]] = {}
        real = _faults.fault

        def fault(point: str, rank: int) -> None:
            key = (threading.current_thread().name, point)
            if key in self.waits:
                arrived, release = self.waits[key]
                arrived.set()
                assert release.wait(30), f"{key} was never released"
            real(point, rank)

        monkeypatch.setattr(_faults, "fault", fault)

    def hold(self, thread: str, point: str) -> tuple[threading.Event, threading.Event]:
        self.waits[(thread, point)] = (threading.Event(), threading.Event())
        return self.waits[(thread, point)]


def _start(name: str, fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["info"] = fn()
        except BaseException as e:  # reported to the test
            out["error"] = e

    t = threading.Thread(target=run, name=name)
    t.start()
    return t, out


def test_two_exclusive_saves_one_wins(where, monkeypatch):
    """overwrite=False: both saves pass the planning check, then race to commit; exactly
    one succeeds, the other raises AlreadyExistsError and removes its own files."""
    path, opts = where
    gate = _Gate(monkeypatch)
    held = {n: gate.hold(n, "commit") for n in ("A", "B")}
    ta, ra = _start("A", lambda: dckpt.save(_state(1), path, storage_options=opts))
    tb, rb = _start("B", lambda: dckpt.save(_state(2), path, storage_options=opts))
    for arrived, _ in held.values():
        assert arrived.wait(30)  # both have written their files; neither has committed
    for _, release in held.values():
        release.set()
    ta.join(30)
    tb.join(30)
    results = {"A": ra, "B": rb}
    winners = [n for n, r in results.items() if "info" in r]
    losers = [n for n, r in results.items() if "error" in r]
    assert len(winners) == 1 and len(losers) == 1, results
    err = results[losers[0]]["error"]
    assert isinstance(err, dckpt.AlreadyExistsError), repr(err)
    gen = 1 if winners[0] == "A" else 2
    _loads_as(path, opts, gen)
    save_id = results[winners[0]]["info"].save_id
    assert [n for n in _names(path, opts) if n.startswith("data-")] == [
        f"data-{save_id}-00000.safetensors"]  # the loser cleaned up after itself


def test_overwrite_commit_keeps_a_concurrent_saves_files(where, monkeypatch):
    """overwrite=True: B commits while A is between writing and committing. B removes
    only the files of the checkpoint it replaced (gen 0), never A's in-flight files, so
    A's later commit is loadable: the last commit wins and both saves were real."""
    path, opts = where
    dckpt.save(_state(0), path, storage_options=opts)
    gate = _Gate(monkeypatch)
    arrived, release = gate.hold("A", "commit")
    ta, ra = _start("A", lambda: dckpt.save(_state(1), path, storage_options=opts,
                                            overwrite=True))
    assert arrived.wait(30)
    info_b = dckpt.save(_state(2), path, storage_options=opts, overwrite=True)
    _loads_as(path, opts, 2)
    release.set()
    ta.join(30)
    assert "info" in ra, ra
    _loads_as(path, opts, 1)
    data = [n for n in _names(path, opts) if n.startswith("data-")]
    # gen 0's files went with B's commit, B's went with A's; nothing of A's is missing.
    assert data == [f"data-{ra['info'].save_id}-00000.safetensors"], (data, info_b)


def test_gc_during_a_save_leaves_it_alone(where, monkeypatch):
    """gc with --min-age 0 while a save's files are written but not committed: the
    save's intent (lease) protects them, and the save commits something loadable."""
    path, opts = where
    parent = path.rsplit("/", 1)[0] if "://" in path else os.path.dirname(path)
    gate = _Gate(monkeypatch)
    arrived, release = gate.hold("A", "commit")
    ta, ra = _start("A", lambda: dckpt.save(_state(3), path, storage_options=opts))
    assert arrived.wait(30)
    assert any(n.startswith("data-") for n in _names(path, opts))
    removed = collect_garbage(parent, min_age_s=0.0, storage_options=opts)
    assert removed == [], removed
    release.set()
    ta.join(30)
    assert "info" in ra, ra
    _loads_as(path, opts, 3)
    assert collect_garbage(parent, min_age_s=0.0, storage_options=opts) == []


def test_a_save_whose_files_vanished_fails(where, monkeypatch):
    """Files removed behind the save's back (a gc without leases, a person) make the
    commit fail with IntegrityError naming the file: nothing is committed."""
    path, opts = where
    gate = _Gate(monkeypatch)
    arrived, release = gate.hold("A", "commit")
    ta, ra = _start("A", lambda: dckpt.save(_state(4), path, storage_options=opts))
    assert arrived.wait(30)
    s, root = make_storage(path, opts)
    for n in _names(path, opts):
        if n.startswith("data-"):
            s.remove(s.join(root, n))
    release.set()
    ta.join(30)
    err = ra.get("error")
    assert isinstance(err, dckpt.IntegrityError) and "missing at commit time" in str(err), ra
    assert "manifest.json" not in _names(path, opts)
    with pytest.raises(dckpt.NotCommittedError):
        dckpt.load(_state(-1), path, storage_options=opts)


def test_stale_intent_of_a_dead_save_is_collected(where):
    """A save that died (its lease ran out) leaves files that gc does remove."""
    from dckpt.protocol.intent import intent_name

    path, opts = where
    parent = path.rsplit("/", 1)[0] if "://" in path else os.path.dirname(path)
    s, root = make_storage(path, opts)
    s.makedirs(root)
    sid = "0123456789abcdef"
    s.touch(s.join(root, intent_name(sid)), b"{}")
    s.touch(s.join(root, f"data-{sid}-00000.safetensors"), b"partial")
    assert collect_garbage(parent, min_age_s=0.0, storage_options=opts) == []
    import dckpt.protocol.intent as intent

    old = intent.LEASE_S
    intent.LEASE_S = 0.0  # the lease ran out
    try:
        found = collect_garbage(parent, min_age_s=0.0, storage_options=opts)
    finally:
        intent.LEASE_S = old
    names = sorted(lo.path.rsplit("/", 1)[-1] for lo in found)
    assert f"data-{sid}-00000.safetensors" in names
    assert not [n for n in _names(path, opts) if sid in n]
