"""CheckpointManager(incremental=True, full_every=K, compression=): chains of
incremental saves, retention that never removes a referenced byte, and a restore that
falls back past a corrupt base. One process."""
from __future__ import annotations

import os

import pytest
import torch

import dckpt
from dckpt.catalog import listing as catalog
from dckpt.catalog import gc as catalog_gc
from dckpt.errors import CheckpointError
from dckpt.format import manifest as mf
from dckpt.catalog.verify import verify_checkpoint
from test_incremental import _flip_in_entry


def _model(seed: int = 0) -> dict:
    """A frozen-backbone fine-tune: 8 MiB frozen, about 0.3 MiB of adapters."""
    g = torch.Generator().manual_seed(seed)
    sd = {f"backbone.{i}": torch.randn(256, 1024, generator=g) for i in range(8)}
    sd.update({"lora.a": torch.randn(256, 64, generator=g), "lora.b": torch.randn(64, 1024, generator=g)})
    return sd


def _train(sd: dict, step: int) -> None:
    sd["lora.a"].add_(0.01 * step)
    sd["lora.b"].mul_(0.99)


def _dirs(root) -> list[str]:
    return sorted(d for d in os.listdir(root) if d.startswith("step-"))


def _manifest(path) -> mf.Manifest:
    with open(os.path.join(path, mf.MANIFEST_NAME), "rb") as f:
        return mf.parse(f.read())


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_keep_last_one_stays_near_one_full_plus_one_delta(tmp_path):
    root = str(tmp_path / "ck")
    sd = _model()
    full = None
    with dckpt.CheckpointManager(root, incremental=True, full_every=4, keep_last=1,
                                 capture_rng=False) as m:
        for step in range(1, 11):
            _train(sd, step)
            assert m.save(step, sd, force=True)
            got = _manifest(m.path(step))
            if step % 4 == 1:  # saves 1, 5, 9 are full
                assert got.referenced_bytes == 0, step
                full = got.total_bytes
            else:
                assert 0 < got.total_bytes <= 0.15 * full, step
                assert got.referenced_bytes >= 0.85 * full, step
            usage, total = catalog.disk_usage(root)
            assert [u.path.rsplit("/", 1)[1] for u in usage] == [f"step-{step:08d}"]
            delta = usage[0].own if step % 4 != 1 else 0
            # One full (the newest chain's) and one delta, plus the few KiB of manifests.
            assert total <= full + delta + 64 * 1024, (step, total, full, delta)
            assert verify_checkpoint(m.path(step)).ok
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    with dckpt.CheckpointManager(root, incremental=True, capture_rng=False) as m2:
        assert m2.restore(back) == 10
    _equal(back, sd)
    assert catalog_gc.find_leftovers(root, min_age_s=0) == []


def test_async_incremental_chain_and_compression(tmp_path):
    root = str(tmp_path / "ck")
    sd = _model(1)
    with dckpt.CheckpointManager(root, incremental=True, full_every=3, keep_last=2,
                                 compression="zstd", async_save=True, capture_rng=False) as m:
        for step in range(1, 6):
            _train(sd, step)
            m.save(step, sd, force=True)
        m.wait()
        kinds = [_manifest(m.path(s)).referenced_bytes > 0 for s in (4, 5)]
    assert kinds == [False, True]  # save 4 starts a new chain, save 5 builds on it
    assert _dirs(root) == ["step-00000004", "step-00000005"]
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    assert dckpt.CheckpointManager(root, capture_rng=False).restore(back) == 5
    _equal(back, sd)


def test_restore_falls_back_past_a_corrupt_base(tmp_path, caplog):
    root = str(tmp_path / "ck")
    sd = _model(2)
    states = {}
    with dckpt.CheckpointManager(root, incremental=True, full_every=2, capture_rng=False) as m:
        for step in (1, 2, 3, 4):  # 1 full, 2 on 1, 3 full, 4 on 3
            _train(sd, step)
            m.save(step, sd, force=True)
            states[step] = {k: v.clone() for k, v in sd.items()}
    base_dir = m.path(3)
    data = sorted(f for f in os.listdir(base_dir) if f.endswith(".safetensors"))[0]
    _flip_in_entry(base_dir, data, "state.backbone.3", at=4096)  # step 4 references it
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    assert dckpt.CheckpointManager(root, capture_rng=False).restore(back) == 2
    _equal(back, states[2])
    warned = "\n".join(r.getMessage() for r in caplog.records)
    assert data in warned  # steps 4 and 3 were skipped naming the damaged file


def test_retention_removes_a_base_only_when_nothing_references_it(tmp_path):
    root = str(tmp_path / "ck")
    sd = _model(3)
    with dckpt.CheckpointManager(root, incremental=True, full_every=100, keep_last=1,
                                 capture_rng=False) as m:
        for step in (1, 2, 3):
            _train(sd, step)
            m.save(step, sd, force=True)
    # Step 1 (the full save) lost its manifest but keeps the files 3 references;
    # step 2's own files (adapters, rewritten by 3) are gone.
    assert _dirs(root) == ["step-00000001", "step-00000003"]
    assert not os.path.exists(os.path.join(m.path(1), mf.MANIFEST_NAME))
    assert {e.path.rsplit("/", 1)[1] for e in catalog.list_checkpoints(root) if e.committed} == {"step-00000003"}
    assert verify_checkpoint(m.path(3)).ok
    # gc keeps them too, and a later full save lets retention remove them.
    assert catalog_gc.collect_garbage(root, min_age_s=0) == []
    with dckpt.CheckpointManager(root, incremental=True, full_every=1, keep_last=1,
                                 capture_rng=False) as m:
        m.save(4, sd, force=True)
    assert _dirs(root) == ["step-00000004"]


def test_first_save_after_restore_is_full_and_overwrite_keeps_references(tmp_path):
    root = str(tmp_path / "ck")
    sd = _model(4)
    with dckpt.CheckpointManager(root, incremental=True, full_every=10, capture_rng=False) as m:
        for step in (1, 2, 3):
            _train(sd, step)
            m.save(step, sd, force=True)
    with dckpt.CheckpointManager(root, incremental=True, full_every=10, capture_rng=False) as m:
        back = {k: torch.zeros_like(v) for k, v in sd.items()}
        assert m.restore(back, step=1) == 1  # a rewind: steps 2 and 3 are abandoned
        _train(back, 2)
        m.save(2, back, force=True)  # overwrites step 2, full; removes step 3
        assert _manifest(m.path(2)).referenced_bytes == 0
        _train(back, 3)
        m.save(3, back, force=True)
        assert _manifest(m.path(3)).referenced_bytes > 0
    for s in (1, 2, 3):
        assert verify_checkpoint(m.path(s)).ok, s


def test_bad_options_are_clear(tmp_path):
    # with local_root they combine (issue 30: tests/tiers/test_tier_incremental.py)
    with pytest.raises(CheckpointError, match="compression"):
        dckpt.CheckpointManager(str(tmp_path / "a"), compression="gzip",
                                local_root=str(tmp_path / "l"))
    with pytest.raises(CheckpointError, match="full_every"):
        dckpt.CheckpointManager(str(tmp_path / "a"), incremental=True, full_every=0)
    with pytest.raises(CheckpointError, match="compression"):
        dckpt.CheckpointManager(str(tmp_path / "a"), compression="gzip")
