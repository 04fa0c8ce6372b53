"""Adversarial review of the Lightning/Fabric fast tier (``local_root``, issue 37):
each test proves one defect found in review (and stays as its regression test)."""
from __future__ import annotations

import gc
import os
import threading
import weakref

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from .test_lightning import _tiny_load, _tiny_save  # noqa: E402


def _lio():
    from dckpt.integrations.lightning import committer as lio

    return lio


def test_corrupt_fast_tier_file_falls_back_to_the_durable_copy(tmp_path, caplog):
    """A local data file damaged after its commit (same size: a flipped byte, found only
    by the checksums at read time) must not make the checkpoint unloadable when its
    durable copy is whole: the load falls back to the durable copy, with a warning."""
    from torch import nn

    lio = _lio()
    io = lio.Committer(local_root=str(tmp_path / "local"))
    model = nn.Linear(3, 2)
    last = str(tmp_path / "ckpts" / "last.ckpt")
    _tiny_save(io, model, last, 3)
    io.finish(drain=True)
    slot = io.tier.slot(lio.durable_name(last))
    data = [f for f in os.listdir(slot) if f.startswith("data-")]
    assert data
    p = os.path.join(slot, data[0])
    with open(p, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        b = f.read(1)
        f.seek(-4, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    assert _tiny_load(io, last) == (3, 3.0)
    assert "fast tier" in caplog.text


def test_remove_then_resave_of_a_name_keeps_the_new_save(tmp_path, monkeypatch):
    """ModelCheckpoint removes a name and later saves the same name again while the copy
    thread is busy: the queued removal must not take the newer local commit (nor its
    copy): the name ends up holding the new save, durably."""
    from torch import nn

    lio = _lio()
    io = lio.Committer(local_root=str(tmp_path / "local"))
    model = nn.Linear(3, 2)
    ck = tmp_path / "ckpts"
    n = str(ck / "n.ckpt")
    monkeypatch.setenv("DCKPT_FAULT", "stage:*:sleep=1")  # the copy thread is busy
    _tiny_save(io, model, str(ck / "m.ckpt"), 1)
    _tiny_save(io, model, n, 2)
    io.remove(n, is_rank0=True)
    _tiny_save(io, model, n, 3)
    io.finish(drain=True)
    monkeypatch.delenv("DCKPT_FAULT")
    assert _tiny_load(lio.Committer(), n) == (3, 3.0)  # the durable copy
    assert _tiny_load(io, n) == (3, 3.0)


def test_a_dropped_committer_is_freed(tmp_path):
    """Strategies made and dropped one after another in one process (a sweep of trials)
    must not keep their fast tier alive: its host staging buffers (a copy of the
    shards, with ``async_save``) and its threads."""
    from torch import nn

    lio = _lio()
    before = threading.active_count()
    refs = []
    for i in range(3):
        io = lio.Committer(local_root=str(tmp_path / "local"), async_save=True)
        _tiny_save(io, nn.Linear(3, 2), str(tmp_path / "ckpts" / f"t{i}.ckpt"), 1)
        io.finish(drain=True)
        refs.append(weakref.ref(io.tier))
        del io
    gc.collect()
    assert all(r() is None for r in refs)
    for _ in range(50):
        if threading.active_count() <= before:
            break
        threading.Event().wait(0.1)
    assert threading.active_count() <= before, threading.enumerate()


def test_local_root_per_node_resumes_from_the_fast_tier(tmp_path):
    """Each rank with its own local_root (as ranks on separate nodes: no rank sees
    another's files), killed after step 4 committed locally and before its copies: the
    restart at the same 2 devices resumes step 4 from the fast tier, as with one shared
    local_root. (Lightning's metadata, ModelCheckpoint's score tensors among it, was
    held by rank 0's files only: rank 1 could not read it from its own node.)"""
    from dckpt.catalog.verify import verify_checkpoint

    from .test_lightning import equal, ref, run

    root, local = str(tmp_path / "run"), str(tmp_path / "local-{rank}")
    run(root, "dckpt", 2, "--max-steps", "8", "--every", "2", "--local-root", local,
        "--kill-before-copy", "4", killed=True)
    assert os.path.isdir(str(tmp_path / "local-1"))
    out = run(root, "dckpt", 2, "--max-steps", "6", "--ckpt-path", "last",
              "--local-root", local)
    assert "TRAIN START global_step=4" in out, out[-3000:]
    assert "from the fast tier" in out and "could not be loaded" not in out
    assert equal(ref(root, "resumed-2"), ref(root, "save-4"))
    for name in os.listdir(os.path.join(root, "ckpts")):
        assert verify_checkpoint(os.path.join(root, "ckpts", name)).ok


# ------------------------------------------------ settings that differ between ranks
DEADLINE = 60


def _save_with(base: str, kw_by_rank: dict) -> str:
    """Every rank makes a Committer with its own settings and saves one checkpoint
    (a Lightning-like tree: its own tensor, the metadata on rank 0), then drains.
    Returns "no error" or the error's type and message."""
    import torch.distributed as dist

    from dckpt.integrations.lightning import committer as lio

    r = dist.get_rank()
    kw = {k: (v.replace("{rank}", str(r)) if isinstance(v, str) else v)
          for k, v in kw_by_rank.get(r, kw_by_rank.get("*", {})).items()}
    try:
        io = lio.Committer(**kw)
        tree = {f"w{r}": torch.full((4,), float(r))}
        if r == 0:
            tree[lio.META_KEY] = lio.meta_entry({"global_step": 1}, [], [])
        io.save(tree, os.path.join(base, "ckpts", "last.ckpt"), step=1)
        io.finish(drain=True)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("case", ["local_root", "async_save", "compression"])
def test_ranks_disagreeing_on_committer_settings_fail_alike(ranks, tmp_path, case):
    """A setting that shapes the collectives (the fast tier on or off, asynchronous
    saves, compression of the durable copies) given differently on some rank (a
    per-node environment variable, say): every rank raises the same CheckpointError
    naming it, within the deadline, instead of entering different collectives."""
    local = str(tmp_path / "local-{rank}")
    kw = {"local_root": ({0: {"local_root": local}, 1: {}}),
          "async_save": ({0: {"local_root": local, "async_save": True},
                          1: {"local_root": local}}),
          "compression": ({0: {"local_root": local, "compression": "zstd"},
                           1: {"local_root": local}})}[case]
    out = ranks(2).run(_save_with, str(tmp_path), kw, timeout=DEADLINE)
    assert len(set(out)) == 1, out
    assert out[0].startswith("CheckpointError") and case in out[0], out[0]


def test_sweep_leaves_another_saves_partial_folder_alone(tmp_path, monkeypatch):
    """The sweep before each save removes the hidden leftovers of killed saves in the
    checkpoint folder, of every name: it must not take the partial folder of a save
    still running there (another job, or another strategy of this one, writing to the
    same dirpath), whose commit would then fail; a leftover of a dead process goes."""
    from torch import nn

    lio = _lio()
    ck = tmp_path / "ckpts"
    a, b = lio.Committer(async_save=True), lio.Committer()
    dead = ck / ".x.ckpt.dckpt-partial-0123456789ab"  # a killed save's leftover
    dead.mkdir(parents=True)
    (dead / ".dckpt-save-0123456789abcdef.intent").write_text(
        '{"save_id": "0123456789abcdef", "host": "%s", "pid": 999999999, "started": 0}'
        % __import__("socket").gethostname())
    monkeypatch.setenv("DCKPT_FAULT", "vote:*:sleep=2")  # a's save is slow
    _tiny_save(a, nn.Linear(3, 2), str(ck / "a.ckpt"), 1)
    threading.Event().wait(0.5)
    assert [e for e in os.listdir(ck) if e.startswith(".a.ckpt")]  # a's save is running
    _tiny_save(b, nn.Linear(3, 2), str(ck / "b.ckpt"), 2)  # sweeps the folder
    a.finish()
    monkeypatch.delenv("DCKPT_FAULT")
    assert _tiny_load(lio.Committer(), str(ck / "a.ckpt")) == (1, 1.0)
    assert not dead.exists()


def test_cleanup_never_removes_a_slot_a_save_began_after_it_looked(tmp_path):
    """Found by CI (test_fast_tier_one_process, once): the copy thread's cleanup took
    its list of protected slots, then listed the local root; a save that began in
    between (its slot marked busy, its directory just made, no view yet) was taken for
    a dead partial slot and removed under the save, which then failed. The cleanup must
    decide on each slot under the lock a save marks its slot with."""
    from torch import nn

    lio = _lio()
    io = lio.Committer(local_root=str(tmp_path / "local"), keep_last_local=1)
    model = nn.Linear(3, 2)
    _tiny_save(io, model, str(tmp_path / "ckpts" / "a.ckpt"), 1)
    io.finish(drain=True)
    tier = io.tier
    fresh = tier.slot(lio.durable_name(str(tmp_path / "ckpts" / "b.ckpt")))
    real = tier.storage.listdir

    def listdir_while_a_save_begins(path):
        if path == tier.root and not os.path.exists(fresh):
            with tier._lock:  # what save() does before it writes
                tier._busy.add(fresh)
            os.makedirs(fresh)
            with open(os.path.join(fresh, "data-0123456789abcdef-00000.safetensors"), "wb") as f:
                f.write(b"being written")
        fired.append(path)
        return real(path)

    fired: list = []
    tier.storage.listdir = listdir_while_a_save_begins
    try:
        tier._cleanup(0)
    finally:
        tier.storage.listdir = real
    assert fired
    assert os.path.isdir(fresh) and os.listdir(fresh), "the cleanup removed a slot a save was writing"
