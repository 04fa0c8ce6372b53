"""Incremental and compressed durable copies under a fast tier (issue 30).

Single process (the manager needs no process group); the fast tier under tmp_path, the
durable root on a local directory and on S3 (moto's server, real s3fs clients). Bytes
uploaded are counted at the storage: the sizes of the data files in the step's durable
directory (what the step owns; referenced files live in its base's directory)."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

import dckpt
from dckpt.catalog.listing import disk_usage
from dckpt.format import manifest as mf
from dckpt.storage.fsspec_storage import make_storage
from dckpt.catalog.verify import verify_checkpoint

MIB_F32 = 1 << 18  # float32 elements in 1 MiB (one hash block)


def _state(step: int) -> dict:
    """~10 MiB: a frozen backbone (9 MiB, the same at every step) and a head that changes
    at every step (1 MiB, 10% of the bytes)."""
    g = torch.Generator().manual_seed(1234)
    backbone = {f"layer{i}": torch.randn(MIB_F32, generator=g) for i in range(9)}
    head = torch.randn(MIB_F32, generator=torch.Generator().manual_seed(step))
    return {"backbone": backbone, "head": head, "step": step}


@pytest.fixture(params=["local", "s3"])
def durable(request, tmp_path):
    """(root URL or path, storage_options) of the durable tier."""
    if request.param == "local":
        return str(tmp_path / "durable"), None
    s3 = request.getfixturevalue("s3")
    return s3.url("tierinc"), s3.options


def _manager(root, opts, shm, **kw) -> dckpt.CheckpointManager:
    kw.setdefault("capture_rng", False)
    kw.setdefault("every_steps", 1)
    return dckpt.CheckpointManager(root, local_root=str(shm), storage_options=opts, **kw)


def _manifest(mgr, step: int) -> mf.Manifest:
    st, path = make_storage(mgr.path(step), mgr.storage_options)
    return mf.parse(st.read_file(st.join(path, mf.MANIFEST_NAME), 1 << 26), path)


def _uploaded(mgr, step: int) -> int:
    """Bytes of the data files in the durable directory of ``step`` (at the storage)."""
    st, path = make_storage(mgr.path(step), mgr.storage_options)
    return sum(e.size for e in st.listdir(path) if e.name.startswith("data-"))


def _data_files(mgr) -> set[str]:
    """Every data file under the durable root, as "step-dir/name"."""
    st, root = make_storage(mgr._root_arg, mgr.storage_options)
    out = set()
    for d in st.listdir(root):
        if d.is_dir and d.name.startswith("step-"):
            out |= {f"{d.name}/{e.name}" for e in st.listdir(st.join(root, d.name))
                    if e.name.startswith("data-")}
    return out


def _restore_durable(root, opts, shm) -> tuple[dict, int, str]:
    """Wipe the fast tier, restore through a new manager: (state, step, tier)."""
    shutil.rmtree(shm, ignore_errors=True)
    mgr = _manager(root, opts, shm)
    st = {"backbone": {f"layer{i}": torch.zeros(MIB_F32) for i in range(9)},
          "head": torch.zeros(MIB_F32), "step": -1}
    step = mgr.restore(st)
    tier = mgr.restored_from
    mgr.close()
    return st, step, tier


def _same(a: dict, b: dict) -> bool:
    return (a["step"] == b["step"] and torch.equal(a["head"], b["head"])
            and all(torch.equal(a["backbone"][k], b["backbone"][k]) for k in b["backbone"]))


def _bitwise(a: dict, b: dict) -> bool:
    flat = lambda s: [s["head"]] + [s["backbone"][k] for k in sorted(s["backbone"])]  # noqa: E731
    return _same(a, b) and all(x.view(torch.int32).equal(y.view(torch.int32))
                               for x, y in zip(flat(a), flat(b)))


def test_frozen_backbone_uploads_only_what_changed(durable, tmp_path):
    root, opts = durable
    shm = tmp_path / "shm"
    mgr = _manager(root, opts, shm, incremental=True, full_every=10)
    sizes = []
    for s in (1, 2, 3):
        assert mgr.save(s, _state(s))
        mgr.wait()  # the durable copy committed
        sizes.append(_uploaded(mgr, s))
    mgr.close()
    full = sizes[0]
    assert full >= 10 << 20  # the first durable copy is full
    assert all(n <= 0.15 * full for n in sizes[1:]), sizes
    # the incremental steps reference the previous ones' files (resolved physically:
    # the backbone lives in step 1's file)
    m3 = _manifest(mgr, 3)
    assert m3.meta.get("base") == "step-00000002" and m3.meta.get("step") == 3
    assert {f.dir for f in m3.files if f.dir} == {"step-00000001"}
    assert m3.referenced_bytes > 9 << 20
    # every copy recorded block hashes (the first, full one too): any can be a base
    assert all(t.blocks is not None for t in _manifest(mgr, 1).tensors.values())
    # verify follows the chain, du tells owned from referenced bytes
    assert verify_checkpoint(mgr.path(3), opts).ok
    usage = {u.path.rstrip("/").rpartition("/")[2]: u for u in disk_usage(root, opts)[0]}
    assert usage["step-00000003"].own == sizes[2]
    assert usage["step-00000003"].referenced >= 9 << 20
    assert usage["step-00000001"].referenced == 0
    # the fast tier is lost: the durable chain restores, bitwise
    st, step, tier = _restore_durable(root, opts, shm)
    assert (step, tier) == (3, "durable") and _bitwise(st, _state(3))


def test_compression_shrinks_a_zeros_heavy_state(durable, tmp_path):
    root, opts = durable
    shm = tmp_path / "shm"

    def zeros_heavy(step: int) -> dict:
        s = _state(step)
        for i in range(8):  # 8 MiB of zeros, 2 MiB of noise
            s["backbone"][f"layer{i}"] = torch.zeros(MIB_F32)
        return s

    mgr = _manager(root, opts, shm, compression="lz4")
    assert mgr.save(1, zeros_heavy(1))
    mgr.wait()
    n = _uploaded(mgr, 1)
    mgr.close()
    assert n < 0.35 * (10 << 20), n  # ~2 MiB of noise (incompressible) plus little
    # the fast tier stays raw and full
    local = sum(p.stat().st_size for p in (shm / "step-00000001").glob("data-*"))
    assert local >= 10 << 20
    assert verify_checkpoint(mgr.path(1), opts).ok
    st, step, tier = _restore_durable(root, opts, shm)
    assert (step, tier) == (1, "durable") and _bitwise(st, zeros_heavy(1))


def test_retention_keeps_the_chain_and_frees_the_rest(durable, tmp_path):
    root, opts = durable
    shm = tmp_path / "shm"
    mgr = _manager(root, opts, shm, incremental=True, keep_last=1, compression="lz4")
    for s in (1, 2, 3):
        assert mgr.save(s, _state(s))
        mgr.wait()
    assert mgr.steps() == [3]
    m3 = _manifest(mgr, 3)
    needed = {f"{f.dir or 'step-00000003'}/{f.name}" for f in m3.files}
    # exactly the files step 3 references are left: step 1's (the backbone) and its
    # own; step 2's file (a head no kept step uses) is gone
    assert _data_files(mgr) == needed
    assert any(n.startswith("step-00000001/") for n in needed)
    assert not any(n.startswith("step-00000002/") for n in needed)
    mgr.close()
    assert verify_checkpoint(mgr.path(3), opts).ok
    st, step, tier = _restore_durable(root, opts, shm)
    assert (step, tier) == (3, "durable") and _bitwise(st, _state(3))


def test_a_damaged_base_makes_the_next_upload_full(durable, tmp_path, caplog):
    root, opts = durable
    shm = tmp_path / "shm"
    mgr = _manager(root, opts, shm, incremental=True)
    for s in (1, 2):
        assert mgr.save(s, _state(s))
        mgr.wait()
    full = _uploaded(mgr, 1)
    assert _uploaded(mgr, 2) <= 0.15 * full
    # step 1's file (which the base, step 2, references for the backbone) is truncated
    st, p1 = make_storage(mgr.path(1), opts)
    name = next(e.name for e in st.listdir(p1) if e.name.startswith("data-"))
    data = st.read_file(st.join(p1, name), 1 << 26)
    st.remove(st.join(p1, name))
    w = st.open_write(st.join(p1, name))
    w.write(memoryview(data[: len(data) // 2]))
    w.commit()
    # verify on the base reports the chain's damaged file
    rep = verify_checkpoint(mgr.path(2), opts)
    assert not rep.ok and any(name in str(p) for p in rep.problems)
    with caplog.at_level(logging.WARNING, logger="dckpt"):
        assert mgr.save(3, _state(3))
        mgr.wait()
    assert "cannot be used" in caplog.text and "this copy is full" in caplog.text
    assert _uploaded(mgr, 3) >= full - (1 << 16)  # full again
    m3 = _manifest(mgr, 3)
    assert "base" not in m3.meta and not any(f.dir for f in m3.files)
    # the next one builds on step 3 again
    assert mgr.save(4, _state(4))
    mgr.wait()
    assert _uploaded(mgr, 4) <= 0.15 * full and _manifest(mgr, 4).meta["base"] == "step-00000003"
    mgr.close()
    st4, step, tier = _restore_durable(root, opts, shm)
    assert (step, tier) == (4, "durable") and _bitwise(st4, _state(4))


def test_full_every_and_restore_restart_the_chain(tmp_path):
    root, shm = str(tmp_path / "durable"), tmp_path / "shm"
    mgr = _manager(root, None, shm, incremental=True, full_every=2)
    for s in (1, 2, 3, 4):
        assert mgr.save(s, _state(s))
        mgr.wait()
    bases = [_manifest(mgr, s).meta.get("base") for s in (1, 2, 3, 4)]
    assert bases == [None, "step-00000001", None, "step-00000003"]
    mgr.close()
    # after a restore (here from the fast tier) the first durable copy is full
    mgr = _manager(root, None, shm, incremental=True, full_every=10)
    st = _state(0)
    assert mgr.restore(st) == 4 and mgr.restored_from == "local" and _same(st, _state(4))
    assert mgr.save(5, _state(5))
    mgr.wait()
    assert _manifest(mgr, 5).meta.get("base") is None
    assert mgr.save(6, _state(6))
    mgr.wait()
    assert _manifest(mgr, 6).meta.get("base") == "step-00000005"
    mgr.close()


def test_after_a_failed_copy_the_next_is_full(tmp_path, monkeypatch):
    root, shm = str(tmp_path / "durable"), tmp_path / "shm"
    mgr = _manager(root, None, shm, incremental=True)
    assert mgr.save(1, _state(1))
    mgr.wait()
    monkeypatch.setenv("DCKPT_FAULT", "stage:0:raise")
    assert mgr.save(2, _state(2))
    with pytest.raises(dckpt.CheckpointError, match="injected fault at stage"):
        mgr.wait()
    monkeypatch.delenv("DCKPT_FAULT")
    assert mgr.steps() == [1] and _data_files(mgr) == {
        f"step-00000001/{f.name}" for f in _manifest(mgr, 1).files}  # no leftover upload
    assert mgr.save(3, _state(3))
    mgr.wait()
    m3 = _manifest(mgr, 3)
    assert "base" not in m3.meta and _uploaded(mgr, 3) >= _uploaded(mgr, 1) - (1 << 16)
    assert mgr.save(4, _state(4))
    mgr.wait()
    assert _manifest(mgr, 4).meta["base"] == "step-00000003"
    mgr.close()


def test_cli_du_and_verify_on_a_staged_chain(tmp_path, capsys):
    from dckpt.cli.main import main

    root, shm = str(tmp_path / "durable"), tmp_path / "shm"
    mgr = _manager(root, None, shm, incremental=True)
    for s in (1, 2):
        assert mgr.save(s, _state(s))
        mgr.wait()
    mgr.close()
    capsys.readouterr()
    assert main(["du", root]) == 0
    rows = {ln.split()[0].rstrip("/").rpartition("/")[2]: ln.split()
            for ln in capsys.readouterr().out.splitlines() if "step-0000000" in ln}
    # step 1 owns ~10 MiB and references nothing; step 2 owns ~1 MiB (the head) and
    # references step 1's file (du counts a referenced file whole: 10 MiB)
    assert set(rows) == {"step-00000001", "step-00000002"}
    assert rows["step-00000001"][1:5] == ["10.0", "MiB", "0", "B"], rows
    assert rows["step-00000002"][1:3] == ["1.0", "MiB"] and rows["step-00000002"][3:5] == \
        ["10.0", "MiB"], rows
    assert main(["verify", mgr.path(2)]) == 0
    assert "OK" in capsys.readouterr().out
    # a file of step 1 (which step 2 references) removed: verify of step 2 names it
    d1 = tmp_path / "durable" / "step-00000001"
    gone = next(d1.glob("data-*"))
    gone.unlink()
    assert main(["verify", mgr.path(2)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and gone.name in out
