"""Issue 34 (2.1, 1.9): `dckpt gc` and `dckpt du` on a fast tier's ``local_root``.

gc kept only the files a ``manifest.json`` names, so on a ``local_root`` (rank views
``manifest-<rank>.json``, replicas under ``peers/``) it deleted the data file of a step
``dckpt ls`` called complete. A local save takes no lease that gc could see, so no file
there can be told from one being written: gc refuses every fast-tier directory and
deletes nothing. du left out ``peers/``."""
from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

import dckpt
from dckpt import CheckpointError
from dckpt.catalog import listing as catalog
from dckpt.catalog import gc as catalog_gc
from dckpt.catalog.local import PEERS
from dckpt.cli.main import main
from dckpt.tiers.identity import META_DIR


def _local_root(tmp_path) -> tuple[str, str]:
    """The issue's setup: step 10 durable, step 11 only in the fast tier. Returns
    (local_root, step 11's directory)."""
    shm = str(tmp_path / "shm")
    mgr = dckpt.CheckpointManager(str(tmp_path / "run"), local_root=shm, every_steps=1,
                                  durable_every_steps=10, capture_rng=False)
    for s in (10, 11):
        assert mgr.save(s, {"w": torch.full((1024,), float(s)), "step": s})
    mgr.close()
    assert mgr.steps(tier="local") == [11]
    return shm, os.path.join(shm, "step-00000011")


def _replicas(shm: str, step: str) -> str:
    """A ``peers/step-<N>`` as a replication leaves it: another node's part under the
    same names, and a view still in transit in ``.incoming``. Returns its directory."""
    peer = os.path.join(shm, PEERS, os.path.basename(step))
    shutil.copytree(step, peer)
    os.makedirs(os.path.join(peer, ".incoming"))
    shutil.copy(os.path.join(step, "manifest-00000.json"),
                os.path.join(peer, ".incoming", "manifest-00001.json"))
    return peer


def _tree(root: str) -> dict[str, int]:
    return {os.path.join(d, n): os.path.getsize(os.path.join(d, n))
            for d, _, names in os.walk(root) for n in names}


def _age(root: str, seconds: float = 7200) -> None:
    t = time.time() - seconds
    for p in _tree(root):
        os.utime(p, (t, t))


def test_gc_refuses_a_local_root_and_deletes_nothing(tmp_path, capsys):
    shm, step = _local_root(tmp_path)
    peer = _replicas(shm, step)
    # a local save in progress: its data file written, its view not yet
    half = os.path.join(shm, "step-00000012")
    os.makedirs(half)
    data = next(n for n in os.listdir(step) if n.startswith("data-"))
    shutil.copy(os.path.join(step, data), os.path.join(half, "data-0123456789abcdef-00000.safetensors"))
    # a peers/ step whose view has not arrived yet: its data files only
    bare = os.path.join(shm, PEERS, "step-00000012")
    os.makedirs(bare)
    shutil.copy(os.path.join(step, data), os.path.join(bare, data))
    _age(shm)  # older than the default --min-age too
    before = _tree(shm)
    for path in (shm, step, half, os.path.join(shm, PEERS), peer, bare):
        for argv in (["gc", "--min-age", "0", path], ["gc", path],
                     ["gc", "--dry-run", "--min-age", "0", path]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.startswith(f"dckpt gc: {path} is ") and "fast tier" in err, err
            assert "deletes nothing" in err and "remove the directory" in err, err
        with pytest.raises(CheckpointError, match="fast tier"):
            catalog_gc.find_leftovers(path, 0)
    assert _tree(shm) == before
    # a local_root whose first save is being written: no view anywhere yet, only the
    # tier's lease directory says what it is
    first = tmp_path / "first"
    (first / META_DIR).mkdir(parents=True)
    (first / "step-00000001").mkdir()
    f = first / "step-00000001" / "data-0123456789abcdef-00000.safetensors"
    f.write_bytes(b"x" * 10)
    _age(str(first))
    for path in (first, first / "step-00000001"):
        assert main(["gc", "--min-age", "0", str(path)]) == 2
        assert "fast tier" in capsys.readouterr().err
    assert f.exists()
    assert main(["ls", shm]) == 0
    assert "local: complete on this node" in capsys.readouterr().out
    assert main(["verify", step]) == 0


def test_gc_still_cleans_a_durable_root_beside_a_local_root(tmp_path, capsys):
    shm, _ = _local_root(tmp_path)
    run = str(tmp_path / "run")
    stray = os.path.join(run, "step-00000099")
    os.makedirs(stray)
    with open(os.path.join(stray, "data-0123456789abcdef-00000.safetensors"), "wb") as f:
        f.write(b"x" * 10)
    _age(stray)
    assert main(["gc", "--min-age", "0", run]) == 0
    assert "removed 1 leftover file(s)" in capsys.readouterr().out
    with dckpt.open(os.path.join(run, "step-00000010")) as ck:  # the durable step is whole
        assert ck["state.w"].tolist() == [10.0] * 1024
    assert main(["gc", "--min-age", "0", str(tmp_path)]) == 0  # their parent: no fast tier there


def test_du_of_a_local_root_counts_the_replicas(tmp_path, capsys):
    """Issue 34 (1.9): 260.6 KiB reported for a local_root holding 533,626 bytes: the
    replicas in peers/step-<N>/ (two levels down) were left out."""
    shm, step = _local_root(tmp_path)
    peer = _replicas(shm, step)
    found, total = catalog.disk_usage(shm)
    assert total == sum(_tree(shm).values())
    rows = {u.path: u for u in found}
    assert set(rows) == {step, peer} and rows[peer].replica and not rows[step].replica
    assert rows[peer].own == rows[step].own > 0
    assert main(["du", shm]) == 0
    out = capsys.readouterr().out
    assert peer in out and "1 checkpoint(s) and 1 replicated step(s) in peers/" in out, out
    # du of peers/ itself measures the same replicas
    found, total = catalog.disk_usage(os.path.join(shm, PEERS))
    assert total == sum(_tree(os.path.join(shm, PEERS)).values())
    assert [u.path for u in found] == [peer]


def test_peers_name_matches_the_tier():
    from dckpt.tiers.peers.part import PEERS as TIER_PEERS

    assert PEERS == TIER_PEERS
