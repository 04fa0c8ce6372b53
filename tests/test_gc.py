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
from dckpt import catalog
from dckpt.cli import main
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
    found = catalog.collect_garbage(str(tmp_path), min_age_s=0)
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
    assert catalog.collect_garbage(str(tmp_path)) == []
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
    catalog.find_leftovers(str(tmp_path), 0)
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
    with caplog.at_level(logging.WARNING, logger="dckpt.catalog"):
        assert main(["gc", "--min-age", "0", f"memory://{name}"]) == 0
    assert fs.exists(stray)
    assert "removed 0 leftover" in capsys.readouterr().out
    assert any("modification time" in r.getMessage() for r in caplog.records)
