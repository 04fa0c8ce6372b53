"""Save history (dckpt.manager.history, ``dckpt history``) and the epoch save policy, in one
process. The multi-rank crash test is tests/multirank/test_crash.py
(test_history_survives_a_killed_save)."""
from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import time

import fsspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dckpt
import dckpt.manager.history
from dckpt.cli.main import main
from dckpt.manager.history import (HISTORY_FILE, SaveHistory, SaveRecord, decode, parse,
                           read_history)
from dckpt.manager.policy import SavePolicy, check_epoch
from dckpt.storage.fsspec_storage import make_storage
from dckpt.storage.local import LocalStorage


def _state(step: int) -> dict:
    return {"w": torch.full((64, 64), float(step)), "step": step}


def _history(root) -> tuple[list[SaveRecord], int]:
    storage, r = make_storage(str(root))
    return read_history(storage, r)


def _rec(step: int, **kw) -> SaveRecord:
    base = dict(step=step, time=1.7e9 + step, tier="durable", mode="sync", bytes=1000 * step,
                blocking_s=0.5, total_s=1.0, world_size=2, epoch=None, save_id=f"{step:016x}")
    return SaveRecord(**{**base, **kw})


# ---------------------------------------------------------------------- epoch policy
def test_epoch_arguments_are_validated():
    assert check_epoch(None) is None and check_epoch(3) == 3
    assert check_epoch(torch.tensor(2)) == 2  # an integer tensor is an index
    for bad in (-1, True, 1.5, "2", torch.tensor(1.0)):
        with pytest.raises(ValueError, match="epoch must be"):
            check_epoch(bad)
    for bad in (0, -2, True, 1.5, "2"):
        with pytest.raises(ValueError, match="every_epochs must be a positive int"):
            SavePolicy(every_epochs=bad)
    with pytest.raises(ValueError, match="every_epochs"):
        dckpt.CheckpointManager("memory://epochs/bad", every_epochs=0)


def test_epoch_due_rules():
    p = SavePolicy(every_epochs=3)
    assert [e for e in range(10) if p.epoch_due(100 + e, None, e, None)] == [2, 5, 8]
    assert not p.epoch_due(10, 9, None, None)  # not at the end of an epoch
    assert not p.epoch_due(30, 20, 5, 5)  # that epoch was seen already (restored)
    assert not p.epoch_due(30, 30, 5, 4)  # that step is the one saved or restored last
    assert not SavePolicy(every_steps=10).epoch_due(30, None, 2, None)  # no epoch policy
    # Composition: any due policy saves.
    both = SavePolicy(every_steps=4, every_epochs=2)
    assert both.due(4, None, 0.0) and both.due(3, None, 0.0, epoch=1, last_epoch=0)
    assert not both.due(3, None, 0.0, epoch=0, last_epoch=None)


def _simulate(policy: SavePolicy, lengths: list[int]) -> tuple[list[int], dict[int, int]]:
    """The manager's loop (one save call per step, epoch= on each epoch's last step),
    with the manager's bookkeeping: (saved steps, {epoch: its last step})."""
    saved, ends, step, last_step, last_epoch = [], {}, 0, None, None
    for epoch, n in enumerate(lengths):
        for i in range(n):
            step += 1
            e = epoch if i == n - 1 else None
            if e is not None:
                ends[e] = step
            if policy.due(step, last_step, None, epoch=e, last_epoch=last_epoch):
                saved.append(step)
                last_step = step
            if e is not None:
                last_epoch = e
    return saved, ends


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 5), k=st.one_of(st.none(), st.integers(1, 12)),
       lengths=st.lists(st.integers(1, 9), min_size=1, max_size=12))
def test_epoch_policy_properties(n, k, lengths):
    policy = SavePolicy(every_steps=k, every_epochs=n)
    saved, ends = _simulate(policy, lengths)
    want_epochs = {ends[e] for e in ends if (e + 1) % n == 0}
    assert want_epochs <= set(saved)  # the end of every n-th epoch is saved
    assert saved == sorted(set(saved))  # never the same step twice
    prev = 0
    for s in saved:  # nothing else is saved but what every_steps asks for
        assert s in want_epochs or (k is not None and s - prev >= k)
        if k is not None:
            assert s - prev <= k
        prev = s
    # A pure function: a second "rank" with its own policy object decides the same.
    assert _simulate(SavePolicy(every_steps=k, every_epochs=n), lengths)[0] == saved
    # After a restore of any saved epoch end, replaying that epoch's end saves nothing.
    for e, s in ends.items():
        if s in saved:
            assert not policy.epoch_due(s, s, e, e) and not policy.epoch_due(s + 1, s, e, e)


def test_manager_saves_every_nth_epoch_composed_with_every_steps(tmp_path):
    root = str(tmp_path / "run")
    with dckpt.CheckpointManager(root, every_steps=7, every_epochs=2, capture_rng=False) as mgr:
        saved, step = [], 0
        for epoch in range(6):  # epochs of 5 steps end at 5, 10, ..., 30
            for i in range(5):
                step += 1
                if mgr.save(step, _state(step), epoch=epoch if i == 4 else None):
                    saved.append(step)
    # every_steps counts from the last save, whichever policy made it
    assert saved == [7, 10, 17, 20, 27, 30]
    recs, _ = _history(root)
    assert [(r.step, r.epoch) for r in recs] == [(7, 0), (10, 1), (17, 2), (20, 3),
                                                 (27, 4), (30, 5)]
    # Restart from the end of epoch 5: replaying that epoch's end does not save again;
    # the next due epoch does.
    mgr = dckpt.CheckpointManager(root, every_epochs=2, capture_rng=False)
    t = _state(0)
    assert mgr.restore(t) == 30 and t["step"] == 30 and mgr.restored_epoch == 5
    assert not mgr.save(30, t, epoch=5)
    assert not mgr.save(35, _state(35), epoch=6)
    assert mgr.save(40, _state(40), epoch=7)
    # A checkpoint saved mid-epoch records the last epoch that had ended.
    assert mgr.restore(_state(0), step=27) == 27 and mgr.restored_epoch == 4
    mgr.close()


def test_epoch_end_in_a_separate_call(tmp_path):
    """The end-of-epoch call after the epoch's last step: saves that step unless the
    call before already did (no second save of the same state)."""
    mgr = dckpt.CheckpointManager(str(tmp_path), every_steps=4, every_epochs=1,
                                  capture_rng=False)
    saved = []
    step = 0
    for epoch in range(3):  # epochs of 4 steps: every end is also a step-policy save
        for _ in range(4):
            step += 1
            if mgr.save(step, _state(step)):
                saved.append(step)
        if mgr.save(step, _state(step), epoch=epoch):
            saved.append(step)
    assert saved == [4, 8, 12]
    mgr = dckpt.CheckpointManager(str(tmp_path / "odd"), every_steps=4, every_epochs=1,
                                  capture_rng=False)
    for s in range(1, 4):
        mgr.save(s, _state(s))
    assert mgr.save(3, _state(3), epoch=0)  # not saved by steps: the epoch policy saves it
    assert not mgr.save(3, _state(3), epoch=0)
    with pytest.raises(ValueError, match="epoch must be"):
        mgr.save(4, _state(4), epoch=-1)
    mgr.close()


# ---------------------------------------------------------------------- history records
def test_sync_save_record_is_written_before_save_returns(tmp_path):
    root = str(tmp_path)
    mgr = dckpt.CheckpointManager(root, every_steps=1, capture_rng=False)
    before = time.time()
    assert mgr.save(1, _state(1), epoch=0)
    recs, bad = _history(root)  # no wait(), no close()
    assert bad == 0 and len(recs) == 1
    r = recs[0]
    m = dckpt.protocol.restore.read_manifest(LocalStorage(), mgr.path(1))[0]
    assert (r.step, r.tier, r.mode, r.world_size, r.epoch) == (1, "durable", "sync", 1, 0)
    assert r.bytes == m.total_bytes > 64 * 64 * 4 and r.save_id == m.save_id
    assert before - 1 <= r.time <= time.time() + 1
    assert 0 < r.blocking_s <= r.total_s and r.throughput == r.bytes / r.total_s
    assert dckpt.manager.history.load_history(root) == recs
    mgr.close()


def test_async_save_records(tmp_path):
    root = str(tmp_path)
    with dckpt.CheckpointManager(root, every_steps=2, async_save=True, keep_last=1,
                                 capture_rng=False) as mgr:
        for s in range(1, 7):
            mgr.save(s, _state(s))
        assert mgr.save(7, _state(7), force=True)
        # Recorded once committed, though nothing waits for this save's handle.
        end = time.time() + 20
        while 7 not in {r.step for r in _history(root)[0]} and time.time() < end:
            time.sleep(0.05)
        assert 7 in {r.step for r in _history(root)[0]}
    recs, bad = _history(root)
    assert bad == 0 and [r.step for r in recs] == [2, 4, 6, 7]
    for r in recs:  # retention removed the checkpoints; their records stay
        assert (r.tier, r.mode, r.world_size) == ("durable", "async", 1)
        assert r.bytes > 0 and 0 < r.blocking_s <= r.total_s


@pytest.mark.parametrize("use_async", [False, True])
def test_fast_tier_records_local_and_staged_durable_commits(tmp_path, use_async):
    root = str(tmp_path / "durable")
    mgr = dckpt.CheckpointManager(root, every_steps=1, local_root=str(tmp_path / "local"),
                                  durable_every_steps=2, async_save=use_async,
                                  capture_rng=False)
    for s in range(1, 5):
        mgr.save(s, _state(s))
    mgr.close()
    recs, bad = _history(root)
    assert bad == 0
    local = {r.step: r for r in recs if r.tier == "local"}
    durable = {r.step: r for r in recs if r.tier == "durable"}
    assert sorted(local) == [1, 2, 3, 4] and sorted(durable) == [2, 4]
    for s, r in local.items():
        assert r.mode == ("async" if use_async else "sync") and r.world_size == 1
        assert r.bytes > 0 and 0 < r.blocking_s <= r.total_s
    for s, r in durable.items():
        assert r.mode == "staged" and r.save_id == local[s].save_id
        assert r.blocking_s == local[s].blocking_s  # one call held up training once
        assert r.total_s >= local[s].total_s and r.bytes == local[s].bytes
    # A restore finds every durable step recorded: nothing to recover.
    mgr = dckpt.CheckpointManager(root, local_root=str(tmp_path / "local"), capture_rng=False)
    assert mgr.restore(_state(0)) == 4
    mgr.close()
    assert _history(root)[0] == recs


def test_torn_last_line_is_skipped_and_earlier_records_survive(tmp_path, caplog):
    """A real torn write: the history fault stops rank 0 half-way through a line (as a
    crash would); the save itself commits, the next append starts a new line."""
    root = str(tmp_path)
    mgr = dckpt.CheckpointManager(root, every_steps=1, capture_rng=False)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    os.environ["DCKPT_FAULT"] = "history:0:raise"
    try:
        with caplog.at_level(logging.WARNING, logger="dckpt.manager.history"):
            assert mgr.save(3, _state(3))  # the history fails, the save does not
    finally:
        del os.environ["DCKPT_FAULT"]
    assert any("could not record the save history" in r.message for r in caplog.records)
    raw = (tmp_path / HISTORY_FILE).read_bytes()
    assert not raw.endswith(b"\n")  # the torn half line is the file's end
    recs, bad = _history(root)
    assert [r.step for r in recs] == [1, 2] and bad == 1
    mgr.save(4, _state(4))
    mgr.close()
    recs, bad = _history(root)
    assert [r.step for r in recs] == [1, 2, 4] and bad == 1
    # The next restore rebuilds step 3's record from its manifest.
    assert dckpt.CheckpointManager(root, capture_rng=False).restore(_state(0)) == 4
    recs, bad = _history(root)
    assert [(r.step, r.mode) for r in recs] == [(1, "sync"), (2, "sync"), (4, "sync"),
                                                (3, "recovered")] and bad == 1
    assert recs[-1].blocking_s is None and recs[-1].bytes == recs[0].bytes


def test_corrupt_line_is_skipped_and_never_hides_the_others(tmp_path, caplog):
    path = tmp_path / HISTORY_FILE
    lines = [_rec(s).encode() for s in range(1, 6)]
    bad = bytearray(lines[2])
    bad[bad.index(b'"bytes":') + 8] ^= 0x01  # one digit changes: still valid JSON
    json.loads(bytes(bad))
    path.write_bytes(b"".join(lines[:2]) + bytes(bad) + b"".join(lines[3:]) + b"\x00garbage")
    with caplog.at_level(logging.WARNING, logger="dckpt.manager.history"):
        recs, n = read_history(LocalStorage(), str(tmp_path))
    assert [r.step for r in recs] == [1, 2, 4, 5] and n == 2
    assert any("skipped 2 torn or corrupt" in r.message for r in caplog.records)
    with pytest.raises(ValueError, match="crc32 mismatch"):
        decode(bytes(bad))
    # an entry with a valid checksum but a wrong type is refused too
    body = b'{"v":1,"step":"x","time":1,"tier":"durable","mode":"sync","bytes":1,' \
           b'"blocking_s":null,"total_s":null,"world_size":1}'
    import zlib
    line = body[:-1] + b',"crc32":"%08x"}' % zlib.crc32(body)
    with pytest.raises(ValueError, match="step"):
        decode(line)


def test_records_round_trip_and_ignore_unknown_members():
    r = _rec(3, epoch=2, blocking_s=None, total_s=None)
    assert decode(r.encode()) == r
    # A newer writer's extra member, with its checksum: still read.
    import zlib
    body = json.dumps({"v": 2, **json.loads(r.encode())}).encode()
    doc = json.loads(body)
    doc.pop("crc32")
    doc["new_field"] = [1, 2]
    body = json.dumps(doc, separators=(",", ":")).encode()
    assert decode(body[:-1] + b',"crc32":"%08x"}' % zlib.crc32(body)) == r
    assert parse(b"\n\n" + r.encode() + b"\n") == ([r], 0)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_history_is_bounded(tmp_path, where):
    root = str(tmp_path) if where == "local" else f"memory://bounded-{os.getpid()}/r"
    storage, r = make_storage(root)
    if where == "local":  # a rewrite a crash interrupted left its temp file
        (tmp_path / f".{HISTORY_FILE}.tmp-0123456789ab").write_bytes(b"partial")
    h = SaveHistory(storage, r, max_records=20, compact_bytes=4096)
    for s in range(1, 201):
        h.append([_rec(s)])
    recs, bad = read_history(storage, r)
    assert bad == 0 and recs[-1].step == 200
    assert [x.step for x in recs] == list(range(201 - len(recs), 201))
    # Locally the rewrite is amortised: it keeps max_records once the file has grown
    # past twice their size (here about 40 records); a rewrite-only store keeps
    # exactly max_records.
    assert 20 <= len(recs) <= 40
    if where == "memory":
        assert len(recs) == 20
    else:
        assert os.listdir(tmp_path) == [HISTORY_FILE]


def test_history_on_an_object_store_like_root(tmp_path):
    """fsspec's memory file system (no append): each record is a read and an atomic
    rewrite; the manager's records, restore and the CLI work the same."""
    root = f"memory://hist-{os.getpid()}/run"
    with dckpt.CheckpointManager(root, every_steps=1, capture_rng=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s), epoch=s - 1)
    recs, bad = _history(root)
    assert [(r.step, r.epoch, r.mode) for r in recs] == [(1, 0, "sync"), (2, 1, "sync"),
                                                         (3, 2, "sync")] and bad == 0
    fs = fsspec.filesystem("memory")
    fs.rm(f"hist-{os.getpid()}/run/{HISTORY_FILE}")
    mgr = dckpt.CheckpointManager(root, capture_rng=False)
    assert mgr.restore(_state(0)) == 3 and mgr.restored_epoch == 2
    recs, _ = _history(root)
    assert sorted((r.step, r.epoch, r.mode) for r in recs) == [
        (1, 0, "recovered"), (2, 1, "recovered"), (3, 2, "recovered")]


# ---------------------------------------------------------------------- CLI
def _run_with_saves(root: str, n: int = 6) -> None:
    with dckpt.CheckpointManager(root, every_steps=1, keep_last=2, capture_rng=False) as mgr:
        for s in range(1, n + 1):
            mgr.save(s, {"w": torch.randn(64 * s, 64), "step": s}, epoch=s // 3)


def test_cli_history_table_and_json(tmp_path, capsys):
    root = str(tmp_path)
    _run_with_saves(root)
    assert main(["history", root]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].split() == ["saved", "step", "epoch", "tier", "mode", "size", "blocking",
                              "total", "throughput", "ranks"]
    rows = out[2:-1]
    assert len(rows) == 6 and out[-1] == "6 of 6 save(s) shown"
    assert [row.split()[2] for row in rows] == ["1", "2", "3", "4", "5", "6"]
    assert all("/s" in row and "durable" in row for row in rows)
    assert main(["history", root, "--last", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert [row.split()[2] for row in out[2:-1]] == ["5", "6"]
    assert main(["history", root, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["step"] for d in doc] == [1, 2, 3, 4, 5, 6]
    assert all(d["throughput_bps"] == d["bytes"] / d["total_s"] for d in doc)
    assert doc[3]["epoch"] == 1 and doc[0]["world_size"] == 1
    assert main(["history", root, "--tier", "local", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_cli_history_without_history(tmp_path, capsys):
    assert main(["history", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no save history" in err and HISTORY_FILE in err
    assert main(["history", str(tmp_path), "--last", "-1"]) == 2
    assert "--last must be >= 0" in capsys.readouterr().err


def _png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_cli_history_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    root = str(tmp_path / "run")
    _run_with_saves(root, n=12)
    png = str(tmp_path / "history.png")
    assert main(["history", root, "--plot", png]) == 0
    assert f"plot written to {png}" in capsys.readouterr().out
    w, h = _png_size(png)
    assert 800 <= w <= 2000 and 600 <= h <= 1500 and os.path.getsize(png) > 20_000
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[:2] == (h, w) and img[..., :3].std() > 0.05  # drawn, not blank


def test_cli_history_plot_without_matplotlib_names_the_extra(tmp_path):
    root = str(tmp_path / "run")
    _run_with_saves(root, n=2)
    code = ("import sys; sys.modules['matplotlib'] = None\n"  # as if it were not installed
            "from dckpt.cli.main import main\n"
            f"sys.exit(main(['history', {root!r}, '--plot', {str(tmp_path / 'x.png')!r}]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "pip install 'dckpt[plot]'" in p.stderr and "matplotlib" in p.stderr
    assert not (tmp_path / "x.png").exists()


def test_plot_of_both_tiers_recovered_records_and_no_timings(tmp_path):
    pytest.importorskip("matplotlib")
    from dckpt.manager.history_plot import plot_history

    recs = []
    for s in range(1, 41):
        recs.append(_rec(s, tier="local", mode="async", epoch=s // 10, bytes=3 << 30))
        if s % 10 == 0:
            recs.append(_rec(s, mode="staged", total_s=4.0, epoch=s // 10, bytes=3 << 30))
    recs.append(_rec(41, mode="recovered", blocking_s=None, total_s=None, bytes=3 << 30))
    png = str(tmp_path / "both.png")
    plot_history(recs, png, title="s3://bucket/run")
    assert _png_size(png)[0] >= 800
    only = str(tmp_path / "recovered.svg")  # another format, from the extension
    plot_history([_rec(s, mode="recovered", blocking_s=None, total_s=None) for s in (1, 2)],
                 only, title="old run")
    assert (tmp_path / "recovered.svg").read_text()[:200].lstrip().startswith("<?xml")
    with pytest.raises(ValueError, match="no save records"):
        plot_history([], str(tmp_path / "none.png"), title="x")
