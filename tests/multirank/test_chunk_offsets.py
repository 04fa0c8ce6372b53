"""Every chunk knows where it belongs, at real gloo ranks (issue 51, defect 14): a save
by 4 writer ranks (the plan derived by rule, the files as rows or as the file table)
whose manifest is then forged to swap two files' cells of one key is refused by
``dckpt.load`` (one process, and 2 ranks resharding into DTensors), ``dckpt.open`` and
``dckpt verify`` with an IntegrityError naming the tensor and the file, never loaded
with a neighbour's values; and a peer asked for a chunk at offsets its file does not
hold refuses to send another one."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

ROWS, COLS = 16, 5


def _full(key: str) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + \
        (1000.0 if key == "v" else 0.0)


def _save(root: str, table: bool) -> list:
    import dckpt
    from dckpt.format import filetable
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {k: distribute_tensor(_full(k), mesh, [Shard(0)], src_data_rank=None)
             for k in ("w", "v")}
    old = filetable.TABLE_MIN_FILES
    filetable.TABLE_MIN_FILES = 1 if table else old
    try:
        info = dckpt.save(state, root)
    finally:
        filetable.TABLE_MIN_FILES = old
    return [info.plan_cached]


def _load_dtensors(root: str) -> tuple[str, str]:
    import dckpt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    got = {k: distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)], src_data_rank=None)
           for k in ("w", "v")}
    try:
        dckpt.load(got, root)
        return "ok", ""
    except Exception as e:
        return type(e).__name__, str(e)


def _forge(root: str, key: str, swap: tuple[int, int], table: bool) -> str:
    """Swap the files of cells ``swap`` of ``key`` in the manifest at ``root`` (resealed:
    a valid manifest whose cell -> file arithmetic is wrong). Returns the name of the
    file the first of them now points at."""
    from dckpt.format import filetable
    from dckpt.format import manifest as mf

    path = os.path.join(root, mf.MANIFEST_NAME)
    m = mf.parse(open(path, "rb").read())
    t = m.tensors[key]
    ids = t.chunks.file.copy()
    a, b = swap
    ids[a], ids[b] = ids[b], ids[a]
    c = mf.Chunks(t.chunks.offsets, t.chunks.sizes, ids, t.chunks.grid)
    tensors = {**m.tensors, key: mf.TensorEntry(key, t.dtype, t.shape, c)}
    m = mf.Manifest(m.save_id, m.world_size, m.created, m.files, tensors, m.values, m.meta)
    old = filetable.TABLE_MIN_FILES
    filetable.TABLE_MIN_FILES = 1 if table else old
    try:
        data = mf.to_json(m)
    finally:
        filetable.TABLE_MIN_FILES = old
    assert (b'"names":"data"' in data) == table
    with open(path, "wb") as f:
        f.write(data)
    return m.files[int(ids[a])].name


@pytest.mark.parametrize("table", [False, True])
def test_swapped_cells_of_writer_files_are_refused(ranks, tmp_path, table):
    import dckpt
    from dckpt.catalog.verify import verify_checkpoint
    from dckpt.errors import IntegrityError

    root = str(tmp_path / "ck")
    # the module's first save is planned by rule (rank 0 derives the file indexes),
    # the second reuses that plan (cached): the same manifest either way
    cached = ranks(4).run(_save, root, table)
    assert len({c[0] for c in cached}) == 1
    got = {k: torch.zeros(ROWS, COLS) for k in ("w", "v")}
    dckpt.load(got, root)
    assert torch.equal(got["w"], _full("w")) and torch.equal(got["v"], _full("v"))
    assert verify_checkpoint(root).ok
    name = _forge(root, "w", (1, 2), table)
    with pytest.raises(IntegrityError) as e:
        dckpt.load({k: torch.zeros(ROWS, COLS) for k in ("w", "v")}, root)
    assert "'w'" in str(e.value) and name in str(e.value), str(e.value)
    ck = dckpt.open(root)
    assert torch.equal(ck["v"], _full("v"))  # the untouched key still reads
    with pytest.raises(IntegrityError, match=f"{name}.*'w'"):
        ck["w"]
    with pytest.raises(IntegrityError, match="'w'"):
        ck.get_slice("w")[4:8]  # rows 4..7: the swapped cell 1
    assert torch.equal(ck.get_slice("w")[0:4], _full("w")[0:4])  # cell 0: still its own
    report = verify_checkpoint(root)
    assert not report.ok and any("'w'" in p and name in p for p in report.problems), \
        report.problems
    out = ranks(2).run(_load_dtensors, root)
    assert all(o[0] == "IntegrityError" and "'w'" in o[1] for o in out), out


def _saved_one_file(root: str) -> tuple[str, object]:
    import dckpt
    from dckpt.format import manifest as mf

    dckpt.save({"a": torch.arange(1000, dtype=torch.float32)}, root)
    m = mf.parse(open(os.path.join(root, "manifest.json"), "rb").read())
    return os.path.join(root, m.files[0].name), m.files[0]


def _transfer(src: str, dst: str, entry, chunks: list) -> tuple[str, str]:
    from dckpt.storage.local import LocalStorage
    from dckpt.tiers.peers.ranges import recv_ranges, send_ranges

    try:
        if dist.get_rank() == 0:
            send_ranges(None, LocalStorage(), src, chunks, 1)
        else:
            recv_ranges(None, dst, entry, chunks, 0)
        return "ok", ""
    except Exception as e:
        return type(e).__name__, str(e)


def test_a_peer_refuses_to_send_a_chunk_at_other_offsets(ranks, tmp_path):
    """A request for ``a`` at offsets (500,) of a file holding ``a``'s chunk at (0,)
    (the bare key): before, the sender found the bare name and sent it."""
    src, entry = _saved_one_file(str(tmp_path / "ck"))
    dst = tmp_path / "node1"
    dst.mkdir()
    t0 = time.monotonic()
    out = ranks(2).run(_transfer, src, str(dst / os.path.basename(src)), entry,
                       [("a", (500,))], timeout=60)
    (k0, m0), (k1, m1) = out
    assert k0 == "IntegrityError" and "'a'" in m0 and "[0]" in m0 and "[500]" in m0, out
    assert k1 != "ok", out
    assert time.monotonic() - t0 < 60
    assert not (dst / os.path.basename(src)).exists()
