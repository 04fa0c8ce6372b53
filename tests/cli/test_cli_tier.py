"""The CLI on a fast tier (issue 27, item 2): ``ls``, ``inspect``, ``verify`` and ``du``
understand a ``local_root`` written by a real CheckpointManager, in one process and by
two gloo ranks sharing one node's ``local_root``."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import dckpt
from dckpt.cli.main import main
from tests.statekit import flip_byte


def _state(step: int) -> dict:
    return {"w": torch.full((16,), float(step)), "step": step}


def _one_process(tmp_path) -> str:
    """A run with a fast tier: steps 10..40 local, 30 durable. Returns local_root."""
    shm = str(tmp_path / "shm")
    mgr = dckpt.CheckpointManager(str(tmp_path / "run"), local_root=shm, every_steps=10,
                                  durable_every_steps=30, capture_rng=False)
    for s in (10, 20, 30, 40):
        assert mgr.save(s, _state(s))
    mgr.close()
    assert mgr.steps(tier="local") == [40]
    return shm


def _rows(out: str) -> list[list[str]]:
    return [r.split("  ") for r in out.strip().splitlines()[2:]]


def test_ls_inspect_verify_du_see_a_one_process_fast_tier(tmp_path, capsys):
    shm = _one_process(tmp_path)
    step = os.path.join(shm, "step-00000040")
    assert main(["ls", shm]) == 0
    out = capsys.readouterr().out
    assert "no checkpoints" not in out, out  # what it said before
    lines = out.strip().splitlines()
    assert lines[0].split() == ["path", "state", "size", "files", "tensors", "ranks", "views",
                                "saved"]
    assert len(lines) == 3 and lines[2].startswith(step), out
    assert "local: complete on this node" in lines[2]
    cells = lines[2].split()
    assert cells[-4:-2] == ["1", "0"], cells  # ranks 1, views of rank 0

    assert main(["inspect", step]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"fast-tier step {step}\n"), out
    assert "complete on this node" in out and "manifest-00000.json" in out
    assert "state.w" in out and "state.step" in out and "40" in out

    assert main(["verify", step]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK {step} (fast-tier step, views of rank(s) 0: complete on this "
                          "node): 1 file(s)"), out

    assert main(["du", shm]) == 0
    out = capsys.readouterr().out
    assert step in out and out.strip().endswith("(every file once: referenced bytes are shared)")
    total = sum(os.path.getsize(os.path.join(step, n)) for n in os.listdir(step))
    assert _rows(out)[0][0] == step and "1 checkpoint(s)" in out
    assert main(["du", step]) == 0  # the step itself
    assert step in capsys.readouterr().out
    from dckpt.catalog.listing import disk_usage
    assert disk_usage(shm)[0][0].own == total

    # the durable root beside it is unchanged: no views column
    assert main(["ls", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "views" not in out.splitlines()[0] and "committed" in out


def test_help_says_what_a_fast_tier_directory_holds(capsys):
    for cmd in ("ls", "inspect", "verify", "du"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        for word in ("local_root", "manifest-<rank>.json", "replica-<id>-<rank>.safetensors",
                     "data-<id>-<rank>.safetensors", "complete on this node"):
            assert word in out, (cmd, word, out)


def _two_rank_save(shm: str, root: str) -> list:
    """On each of 2 gloo ranks sharing ``shm`` (one node): steps 1 and 2 in the fast
    tier, a row-sharded tensor, a replicated one (each rank keeps a replica), a value."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mgr = dckpt.CheckpointManager(root, local_root=shm, every_steps=1, durable_every_steps=100,
                                  keep_last_local=2, capture_rng=False)
    for s in (1, 2):
        full = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024) + s
        state = {"x": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
                 "rep": torch.full((4096,), float(s)), "step": s}
        assert mgr.save(s, state)
    mgr.close()
    return mgr.steps(tier="local")


def test_two_ranks_views_complete_then_damaged(tmp_path, capsys, ranks):
    shm, root = str(tmp_path / "shm"), str(tmp_path / "run")
    assert ranks(2).run(_two_rank_save, shm, root) == [[1, 2], [1, 2]]
    s1, s2 = os.path.join(shm, "step-00000001"), os.path.join(shm, "step-00000002")
    names = sorted(os.listdir(s2))
    # rank 0 writes the replicated tensor, rank 1 keeps its replica of it
    assert [n.split("-")[0] for n in names] == ["data", "data", "manifest", "manifest",
                                                "replica"], names
    assert names[-1].endswith("-00001.safetensors")

    assert main(["ls", shm]) == 0
    rows = capsys.readouterr().out.strip().splitlines()[2:]
    assert [r.split()[0] for r in rows] == [s1, s2]
    for r in rows:
        assert "local: complete on this node" in r and r.split()[-3] == "0-1", r

    assert main(["inspect", s2]) == 0
    out = capsys.readouterr().out
    assert "by 2 rank(s)" in out and "views of rank(s) 0-1 here" in out
    assert "manifest-00001.json" in out and "replica-" in out and "64x1024" in out
    assert main(["inspect", "--json", "--rank", "1", s2]) == 0
    assert '"view_of_rank":1' in capsys.readouterr().out

    assert main(["verify", s2]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK {s2} (fast-tier step, views of rank(s) 0-1: complete on this "
                          "node): 3 file(s)"), out

    # a flipped byte in rank 1's data file: the file, the byte range and the tensor region
    data1 = os.path.join(s2, next(n for n in names if n.startswith("data-") and
                                  n.endswith("-00001.safetensors")))
    size = os.path.getsize(data1)
    flip_byte(data1, size - 10, 0x10)
    assert main(["verify", s2]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAILED {s2} (fast-tier step"), out
    assert data1 in out and "fails its checksum" in out
    import re
    m = re.search(r"bytes (\d+)\.\.(\d+) of the file \(closed range\) hold state\.x\[(\d+), (\d+)\]"
                  r"\.\.state\.x\[63, 1023\] \(row-major in its saved chunk "
                  r"state\.x\[32:64, 0:1024\]\)", out)
    assert m, out
    lo, hi = int(m.group(1)), int(m.group(2))
    assert lo <= size - 10 <= hi == size - 1, (lo, hi, size)
    assert 32 <= int(m.group(3)) <= 63

    # rank 1's view gone (a save that did not finish there, or another node's rank)
    os.remove(os.path.join(s1, "manifest-00001.json"))
    assert main(["ls", shm]) == 0
    row = capsys.readouterr().out.strip().splitlines()[2]
    assert row.startswith(s1) and "local: incomplete on this node: views of rank(s) 0 of 2, " \
        "not 1" in row and row.split()[-3] == "0", row
    assert main(["verify", s1]) == 0  # what this node holds is intact
    assert "incomplete on this node" in capsys.readouterr().out

    # views of two saves: rank 1's from step 2 copied into step 1
    shutil.copy(os.path.join(s2, "manifest-00001.json"), os.path.join(s1, "manifest-00001.json"))
    assert main(["ls", shm]) == 0
    row = capsys.readouterr().out.strip().splitlines()[2]
    assert "local: views of different saves" in row, row
    assert main(["verify", s1]) == 1
    assert "views of different saves" in capsys.readouterr().out
