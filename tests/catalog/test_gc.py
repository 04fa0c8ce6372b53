"""dckpt gc: what it may delete (dckpt's own leftovers, inside the root, old enough, of no
save in progress) and what it must never touch (links, files outside, live saves)."""
from __future__ import annotations

import datetime as dt
import logging
import os
import time
import uuid

import fsspec
import pytest
import torch

import dckpt
from dckpt.catalog import listing as catalog
from dckpt.catalog import gc as catalog_gc
from dckpt.cli.main import main
from dckpt.storage import fsspec_storage

SID = "00000000000000ab"
OLD = time.time() - 7200
OLD_DT = dt.datetime.fromtimestamp(OLD, tz=dt.timezone.utc)


def _old(*paths) -> None:
    for p in paths:
        os.utime(p, (OLD, OLD), follow_symlinks=False)


def _file(path, data=b"\0" * 10) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def test_symlinked_directory_out_of_the_root_is_never_entered(tmp_path, capsys):
    outside, root = tmp_path / "outside", tmp_path / "root"
    outside.mkdir()
    root.mkdir()
    victim = _file(outside / f"data-{SID}-00000.safetensors")
    tmp_manifest = _file(outside / ".manifest.json.tmp-abc123")
    _old(victim, tmp_manifest)
    os.symlink(outside, root / "escape")
    _old(root / "escape")
    assert main(["gc", "--min-age", "0", str(root)]) == 0
    assert os.path.exists(victim) and os.path.exists(tmp_manifest)
    assert "removed 0 leftover" in capsys.readouterr().out


def test_symlinked_file_with_a_dckpt_name_is_left_alone(tmp_path, capsys):
    root, target = tmp_path / "root", tmp_path / "precious.bin"
    (root / "ck").mkdir(parents=True)
    _file(target)
    links = [root / f"data-{SID}-00000.safetensors", root / "ck" / f"data-{SID}-00001.safetensors"]
    for link in links:
        os.symlink(target, link)
    _old(target, *links)
    assert main(["gc", "--min-age", "0", str(root)]) == 0
    assert all(os.path.islink(link) for link in links) and target.exists()
    assert "removed 0 leftover" in capsys.readouterr().out


def test_gc_only_deletes_dckpt_names_directly_under_the_root(tmp_path):
    (tmp_path / "a" / "deep").mkdir(parents=True)
    deep = _file(tmp_path / "a" / "deep" / f"data-{SID}-00000.safetensors")
    mine = _file(tmp_path / "a" / "notes.safetensors")
    top = _file(tmp_path / f"data-{SID}-00003.safetensors")
    _old(deep, mine, top)
    found = catalog_gc.collect_garbage(str(tmp_path), min_age_s=0)
    assert [lo.path for lo in found] == [top]
    assert os.path.exists(deep) and os.path.exists(mine) and not os.path.exists(top)


def _intent(d, sid=SID) -> str:
    return _file(d / f".dckpt-save-{sid}.intent", b"{}")


def test_a_save_in_progress_is_never_collected_whatever_min_age(tmp_path, capsys):
    ck = tmp_path / "step-9"
    ck.mkdir()
    intent = _intent(ck)  # fresh: the save's heartbeat is renewing it
    data = [_file(ck / f"data-{SID}-{r:05d}.safetensors") for r in range(2)]
    tmp_manifest = _file(ck / ".manifest.json.tmp-0123abcd")
    other = _file(ck / "data-00000000000000cd-00000.safetensors")  # another, dead save
    _old(*data, tmp_manifest, other)
    assert main(["gc", "--min-age", "0", str(tmp_path)]) == 0
    assert all(os.path.exists(p) for p in (intent, *data, tmp_manifest))
    assert not os.path.exists(other)
    capsys.readouterr()

    _old(intent)  # the lease ran out: the save died
    assert main(["gc", "--min-age", "0", str(tmp_path)]) == 0
    assert not any(os.path.exists(p) for p in (intent, *data, tmp_manifest))
    assert "removed 4 leftover" in capsys.readouterr().out


def test_a_stale_intent_younger_than_min_age_stays(tmp_path):
    intent = _intent(tmp_path)
    t = time.time() - 600  # past the 120 s lease, not past the 3600 s default min-age
    os.utime(intent, (t, t))
    assert catalog_gc.collect_garbage(str(tmp_path)) == []
    assert os.path.exists(intent)


def test_listing_comes_before_the_manifest_read(tmp_path, monkeypatch):
    """The race with a commit: the save removes its intent only after its manifest is
    committed, so gc must list first and read the manifest second."""
    order = []
    real_read = catalog._read
    monkeypatch.setattr(catalog, "_read", lambda s, p: order.append(("read", p)) or real_read(s, p))
    storage_cls = type(catalog.make_storage(str(tmp_path))[0])
    real_list = storage_cls.listdir
    monkeypatch.setattr(storage_cls, "listdir",
                        lambda self, p: order.append(("list", p)) or real_list(self, p))
    (tmp_path / "ck").mkdir()
    catalog_gc.find_leftovers(str(tmp_path), 0)
    for d in (str(tmp_path), str(tmp_path / "ck")):
        assert order.index(("list", d)) < order.index(("read", d)), order


@pytest.fixture
def mem():
    """A fresh memory:// root, removed afterwards (the memory file system is global)."""
    fs = fsspec.filesystem("memory")
    name = f"gc-{uuid.uuid4().hex[:8]}"
    yield fs, name
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def test_gc_on_an_object_store_reads_its_time_key(mem, capsys):
    fs, name = mem
    root = f"/{name}"
    dckpt.save({"w": torch.ones(3), "step": 1}, f"memory://{name}/step-1")
    stray, young = f"{root}/step-1/data-{SID}-00001.safetensors", f"{root}/data-{SID}-00000.safetensors"
    fs.pipe_file(stray, b"x" * 5)
    fs.pipe_file(young, b"y")
    fs.store[stray].created = OLD_DT  # the memory file system's time key is "created"
    assert main(["gc", "--min-age", "60", f"memory://{name}/"]) == 0
    out = capsys.readouterr().out
    assert f"removed memory://{name}/step-1/data-{SID}-00001.safetensors" in out
    assert not fs.exists(stray) and fs.exists(young)
    assert main(["verify", f"memory://{name}/step-1"]) == 0
    assert capsys.readouterr().out.startswith(f"OK memory://{name}/step-1:")


def test_no_modification_time_means_never_deleted(mem, monkeypatch, caplog, capsys):
    fs, name = mem
    stray = f"/{name}/ck/data-{SID}-00000.safetensors"
    fs.pipe_file(stray, b"x")
    fs.store[stray].created = OLD_DT
    monkeypatch.setattr(fsspec_storage, "entry_mtime", lambda info: None)
    with caplog.at_level(logging.WARNING, logger="dckpt.catalog.listing"):
        assert main(["gc", "--min-age", "0", f"memory://{name}"]) == 0
    assert fs.exists(stray)
    assert "removed 0 leftover" in capsys.readouterr().out
    assert any("modification time" in r.getMessage() for r in caplog.records)


# --- references into the directory gc is given (incremental saves) ---------------------

def _sd(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"frozen": torch.randn(512, 1024, generator=g), "head": torch.randn(64, 64, generator=g),
            "step": seed}


def _loads_bitwise(path: str, want: dict) -> None:
    got = dckpt.load({k: (torch.zeros_like(v) if torch.is_tensor(v) else None)
                      for k, v in want.items()}, path)
    for k, v in want.items():
        if torch.is_tensor(v):
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def _stray(d) -> str:
    """A true leftover: a dead save's data file that no manifest names."""
    return _file(os.path.join(d, "data-00000000000000ee-00003.safetensors"), b"z" * 7)


def _referenced(parent: str, by: str, into: str) -> set[str]:
    """The names in ``parent/into`` that ``parent/by``'s manifest references."""
    st, d = catalog.make_storage(f"{parent}/{by}")
    return {f.name for f in catalog._read(st, d)[0].files if f.dir == into}


def _own_base_overwrite(root: str) -> tuple[dict, dict, str]:
    """step-1 (full), step-2 (base step-1: "frozen" references step-1's data file), then
    step-1 overwritten with base step-2: its new manifest references its OWN old data
    file (``dir`` = "step-1", resolved through step-2)."""
    sd1 = _sd(1)
    dckpt.save(sd1, f"{root}/step-1")
    sd2 = dict(sd1, head=sd1["head"] + 1, step=2)
    dckpt.save(sd2, f"{root}/step-2", base=f"{root}/step-1")
    sd3 = dict(sd1, head=sd1["head"] + 2, step=3)
    dckpt.save(sd3, f"{root}/step-1", base=f"{root}/step-2", overwrite=True)
    return sd2, sd3, f"{root}/step-1"


def test_gc_on_a_checkpoint_that_references_its_own_old_file(tmp_path, capsys):
    root = str(tmp_path / "run")
    sd2, sd3, ck = _own_base_overwrite(root)
    m = catalog._read(catalog.make_storage(ck)[0], ck)[0]
    own_old = {f.name for f in m.files if f.dir == "step-1"}
    assert own_old and all(os.path.exists(os.path.join(ck, n)) for n in own_old)
    stray = _stray(ck)
    assert main(["gc", "--min-age", "0", ck]) == 0
    assert f"removed {stray}" in capsys.readouterr().out
    assert not os.path.exists(stray)  # a true leftover still goes
    assert all(os.path.exists(os.path.join(ck, n)) for n in own_old)
    _loads_bitwise(ck, sd3)
    _loads_bitwise(f"{root}/step-2", sd2)
    # the same from the root, and a second pass finds nothing more
    assert catalog_gc.collect_garbage(root, min_age_s=0) == []
    _loads_bitwise(ck, sd3)


def test_gc_on_the_base_dir_of_a_step_retention_kept(tmp_path):
    root = str(tmp_path / "ck")
    sd = _sd(0)
    with dckpt.CheckpointManager(root, incremental=True, keep_last=1, capture_rng=False) as mgr:
        assert mgr.save(1, sd, force=True)
        sd["head"] += 1
        assert mgr.save(2, sd, force=True)
        base_dir = mgr.path(1)
    # retention removed step 1's manifest and kept the data file step 2 references
    assert not os.path.exists(os.path.join(base_dir, "manifest.json"))
    kept = set(os.listdir(base_dir))
    assert kept
    stray = _stray(base_dir)
    found = catalog_gc.collect_garbage(base_dir, min_age_s=0)
    assert [lo.path for lo in found] == [stray] and not os.path.exists(stray)
    assert set(os.listdir(base_dir)) == kept
    with dckpt.CheckpointManager(root, capture_rng=False) as mgr:
        got = {k: (torch.zeros_like(v) if torch.is_tensor(v) else None) for k, v in sd.items()}
        assert mgr.restore(got) == 2
        assert torch.equal(got["frozen"], sd["frozen"]) and torch.equal(got["head"], sd["head"])


def test_gc_on_the_base_dir_on_an_object_store(mem):
    fs, name = mem
    root = f"memory://{name}"
    sd2, sd3, ck = _own_base_overwrite(root)
    stray = f"/{name}/step-1/data-00000000000000ee-00003.safetensors"
    fs.pipe_file(stray, b"z" * 7)
    fs.rm(f"/{name}/step-1/manifest.json")  # as retention does: manifest first, files kept
    kept = _referenced(root, "step-2", "step-1")
    assert kept
    found = catalog_gc.collect_garbage(f"{root}/step-1/", min_age_s=0)
    left = {n.rpartition("/")[2] for n in fs.ls(f"/{name}/step-1", detail=False)}
    assert left == kept  # the overwrite's own data file and the stray went, nothing else
    assert f"{root}/step-1/data-00000000000000ee-00003.safetensors" in [lo.path for lo in found]
    _loads_bitwise(f"{root}/step-2", sd2)


def test_gc_of_a_root_checks_the_manifests_beside_it(tmp_path):
    """A root that is itself a checkpoint dir: a sibling of it references its files."""
    parent = str(tmp_path / "p")
    sd2, _, ck = _own_base_overwrite(parent)
    os.remove(os.path.join(ck, "manifest.json"))
    stray = _stray(ck)
    os.makedirs(os.path.join(ck, "sub"))
    deep = _stray(os.path.join(ck, "sub"))  # in a subdirectory: only step-1/* could name it
    kept = _referenced(parent, "step-2", "step-1")
    unreferenced = {os.path.join(ck, n) for n in os.listdir(ck) if n.startswith("data-")
                    and n not in kept}
    assert stray in unreferenced and len(unreferenced) == 2  # + the overwrite's own file
    found = {lo.path for lo in catalog_gc.collect_garbage(ck, min_age_s=0)}
    assert found == unreferenced | {deep}
    assert {n for n in os.listdir(ck) if n.startswith("data-")} == kept
    _loads_bitwise(f"{parent}/step-2", sd2)


def test_an_unreadable_sibling_manifest_keeps_the_data_files(tmp_path, caplog):
    parent = str(tmp_path / "p")
    _own_base_overwrite(parent)
    os.remove(os.path.join(parent, "step-1", "manifest.json"))
    before = set(os.listdir(os.path.join(parent, "step-1")))
    with open(os.path.join(parent, "step-2", "manifest.json"), "r+b") as f:
        f.write(b"{garbage")
    with caplog.at_level(logging.WARNING, logger="dckpt.catalog.listing"):
        assert catalog_gc.collect_garbage(os.path.join(parent, "step-1"), min_age_s=0) == []
    assert set(os.listdir(os.path.join(parent, "step-1"))) == before
    assert any("unreadable manifest" in r.getMessage() for r in caplog.records)


def _incremental_behind_a_link(tmp_path):
    """run/step-1, and an incremental step-2 on it moved to elsewhere/ and reached
    through the link run/latest; returns (run, elsewhere, step-2's state)."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    sd1 = _sd(1)
    dckpt.save(sd1, str(run / "step-1"))
    sd2 = dict(sd1, head=sd1["head"] + 1, step=2)
    dckpt.save(sd2, str(run / "step-2"), base=str(run / "step-1"))
    os.rename(run / "step-2", elsewhere / "step-2")
    os.symlink(elsewhere / "step-2", run / "latest")
    return run, elsewhere, sd2


def test_a_checkpoint_loaded_through_a_link_keeps_what_it_references(tmp_path):
    """gc never deletes through a link, but reads the manifest behind one: a load of
    ``run/latest`` resolves its references beside the link, in ``run/``."""
    run, elsewhere, sd2 = _incremental_behind_a_link(tmp_path)
    os.remove(run / "step-1" / "manifest.json")
    kept = set(os.listdir(run / "step-1"))
    for target in (str(run / "step-1"), str(run)):
        assert catalog_gc.collect_garbage(target, min_age_s=0) == []
        assert set(os.listdir(run / "step-1")) == kept
    _loads_bitwise(str(run / "latest"), sd2)
    assert set(os.listdir(elsewhere / "step-2")) >= {"manifest.json"}


def test_an_overwrite_keeps_what_a_checkpoint_behind_a_link_references(tmp_path):
    """Overwriting a base removes only the old files no sibling references, and a
    checkpoint reached through a link in the same directory counts as a sibling (its
    load resolves its references beside the link), as it does for gc."""
    run, elsewhere, sd2 = _incremental_behind_a_link(tmp_path)
    dckpt.save(_sd(3), str(run / "step-1"), overwrite=True)
    _loads_bitwise(str(run / "latest"), sd2)
    _loads_bitwise(str(run / "step-1"), _sd(3))


def test_gc_on_a_base_prefix_on_s3(s3):
    """The same reference rules on a real S3 API (moto): prefixes are directories, and
    the base of a newer step keeps what that step references when gc is given it."""
    from dckpt.storage.fsspec_storage import make_storage

    root, opts = s3.url("gcrefs"), s3.options
    sd1 = _sd(1)
    dckpt.save(sd1, f"{root}/step-1", storage_options=opts)
    sd2 = dict(sd1, head=sd1["head"] + 1, step=2)
    dckpt.save(sd2, f"{root}/step-2", base=f"{root}/step-1", storage_options=opts)
    st, base = make_storage(root, opts)
    st.remove(st.join(base, "step-1", "manifest.json"))  # as retention does
    stray = st.join(base, "step-1", "data-00000000000000ee-00003.safetensors")
    st.put_atomic(stray, b"z" * 7)
    found = catalog_gc.collect_garbage(f"{root}/step-1", min_age_s=0, storage_options=opts)
    assert [lo.where for lo in found] == [stray]
    left = {e.name for e in st.listdir(st.join(base, "step-1"))}
    assert left and all(n.startswith("data-") for n in left) and stray.rpartition("/")[2] not in left
    got = {k: (torch.zeros_like(v) if torch.is_tensor(v) else None) for k, v in sd2.items()}
    dckpt.load(got, f"{root}/step-2", storage_options=opts)
    assert torch.equal(got["frozen"], sd2["frozen"]) and torch.equal(got["head"], sd2["head"])
