"""The file table and the vote records at 4 gloo ranks (issue 38): a save whose
manifest holds its files as a table (format version 4; here from 1 file on, the
threshold lowered in every rank's process) loads, verifies, reshards into 2 ranks and
is collected by gc like any other; a cached later save writes one too; a rank that
fails its write (a JSON vote among records) fails the save on every rank with the same
error naming it, nothing committed; and the old row form still loads."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def _state(step: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(13 * 5, dtype=torch.float32).reshape(13, 5) + step  # uneven
    return {"w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
            "v": distribute_tensor(full[:2].clone(), mesh, [Shard(0)], src_data_rank=None),
            "b": torch.full((4,), float(step)), "step": step}


def _check(path: str, step: int) -> None:
    import dckpt

    want = _state(step)
    got = {k: (torch.zeros_like(v) if torch.is_tensor(v) else None) for k, v in want.items()}
    dckpt.load(got, path)
    assert got["step"] == step and torch.equal(got["b"], want["b"])
    for k in ("w", "v"):
        assert torch.equal(got[k].full_tensor(), want[k].full_tensor()), k


def _saves(root: str, fail_rank: int) -> list:
    import dckpt
    from dckpt.format import filetable

    old, filetable.TABLE_MIN_FILES = filetable.TABLE_MIN_FILES, 1
    try:
        out = []
        for step in range(3):
            info = dckpt.save(_state(step), f"{root}/s{step}")
            out.append(info.plan_cached)
            _check(f"{root}/s{step}", step)
        os.environ["DCKPT_FAULT"] = f"vote:{fail_rank}:raise"
        try:
            dckpt.save(_state(9), f"{root}/bad")
        except dckpt.CheckpointError as e:
            out.append((type(e).__name__, str(e), sorted(e.failures)))
        finally:
            del os.environ["DCKPT_FAULT"]
        dist.barrier()
        out.append(sorted(os.listdir(f"{root}/bad")) if os.path.isdir(f"{root}/bad") else [])
        return out
    finally:
        filetable.TABLE_MIN_FILES = old


def _load_2(path: str, step: int) -> None:
    _check(path, step)


def test_table_saves_load_and_a_failed_vote_reaches_every_rank(ranks, tmp_path):
    import dckpt
    from dckpt.catalog.gc import collect_garbage
    from dckpt.catalog.verify import verify_checkpoint

    root = str(tmp_path)
    got = ranks(4).run(_saves, root, 2)
    assert all(g == got[0] for g in got), "every rank returns and raises alike"
    assert got[0][:3] == [False, True, True]
    name, msg, failures = got[0][3]
    assert name == "RankFailure" and "failed on rank 2" in msg and "injected fault at vote" in msg
    assert failures == [2]
    assert not [f for f in got[0][4] if f == "manifest.json" or f.endswith(".safetensors")]
    for step in range(3):
        with open(f"{root}/s{step}/manifest.json", "rb") as f:
            doc = json.loads(f.read())
        assert doc["version"] == 4 and doc["files"]["names"] == "data", doc["files"]
        assert doc["files"]["rank"] == {"runs": [[0, 1, 4]]}
        m = dckpt.open(f"{root}/s{step}")
        assert torch.equal(m["w"], torch.arange(65.0).reshape(13, 5) + step)
        files = sorted(n for n in os.listdir(f"{root}/s{step}") if n.endswith(".safetensors"))
        assert files == sorted(f.name for f in m.manifest.files) and len(files) == 4
        assert verify_checkpoint(f"{root}/s{step}").ok
    # reshard into 2 ranks
    ranks(2).run(_load_2, f"{root}/s2", 2)
    # the same checkpoint with its manifest in the row form (as dckpt wrote it before
    # the table, version 2 or 3) loads alike
    from dckpt.format import manifest as mf

    with open(f"{root}/s2/manifest.json", "rb") as f:
        m = mf.parse(f.read())
    rows = mf.to_json(m)  # below the threshold here: rows
    assert json.loads(rows)["version"] in (2, 3) and isinstance(json.loads(rows)["files"], list)
    with open(f"{root}/s2/manifest.json", "wb") as f:
        f.write(rows)
    ranks(2).run(_load_2, f"{root}/s2", 2)
    assert verify_checkpoint(f"{root}/s2").ok
    # gc keeps the table's files, removes a stray one
    stray = f"{root}/s1/data-ffffffffffffffff-00000.safetensors"
    open(stray, "wb").close()
    gone = collect_garbage(f"{root}/s1", min_age_s=0)
    assert [g.path for g in gone] == [stray] or [os.path.basename(g.path) for g in gone] == \
        [os.path.basename(stray)], gone
    assert not os.path.exists(stray) and verify_checkpoint(f"{root}/s1").ok
    assert len([n for n in os.listdir(f"{root}/s1") if n.endswith(".safetensors")]) == 4
