"""Tiers across ranks: every rank has its own ``local_root`` (node-local, never shared),
so a restore from the fast tier proves each rank served its part from its own node."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist


def _state(step: int) -> dict:
    """A sharded DTensor (each rank its part), a replicated plain tensor (written once in
    the durable tier, kept by every rank locally) and a plain value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(48 * 8, dtype=torch.float32).reshape(48, 8) + step
    return {"x": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
            "rep": torch.full((64,), float(step)), "step": step}


def _same(a: dict, b: dict) -> bool:
    return (torch.equal(a["x"].to_local(), b["x"].to_local()) and torch.equal(a["rep"], b["rep"])
            and a["step"] == b["step"])


def _manager(base: str, **kw):
    import dckpt

    kw.setdefault("capture_rng", False)
    return dckpt.CheckpointManager(os.path.join(base, "durable"), every_steps=1,
                                   local_root=os.path.join(base, f"node{dist.get_rank()}"), **kw)


def _flip(path: str, at: int = -8) -> None:
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_END)
        b = f.read(1)
        f.seek(at, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def _data_files(d: str) -> list[str]:
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.startswith("data-"))


def _save_steps(base: str, steps: list[int], kw: dict | None = None) -> tuple:
    mgr = _manager(base, **(kw or {}))
    for s in steps:
        assert mgr.save(s, _state(s))
    mgr.close()
    return mgr.steps(), mgr.steps(tier="local")


def _restore(base: str, damage: str = "") -> tuple:
    r = dist.get_rank()
    if damage == "durable" and r == 0:  # the durable copy of the newest step is corrupt
        for f in _data_files(os.path.join(base, "durable", "step-00000003")):
            _flip(f)
    if damage == "wipe" and r == 1:  # a lost node: its fast tier is empty
        shutil.rmtree(os.path.join(base, "node1"))
    if damage == "corrupt-local" and r == 1:
        for f in _data_files(os.path.join(base, "node1", "step-00000003")):
            _flip(f)
    dist.barrier()
    mgr = _manager(base)
    st = _state(0)
    step = mgr.restore(st)
    ok = step is not None and _same(st, _state(step))
    mgr.close()
    return step, mgr.restored_from, ok


def test_restore_from_local_then_fallbacks(ranks, tmp_path):
    base = str(tmp_path)
    out = ranks(2).run(_save_steps, base, [1, 2, 3], dict(keep_last=2, keep_last_local=1))
    assert out == [([2, 3], [3])] * 2
    for r in (0, 1):  # each rank's own files: its data (sharded part) and its replicas
        names = os.listdir(os.path.join(base, f"node{r}", "step-00000003"))
        assert f"manifest-{r:05d}.json" in names and not any(f"-{1 - r:05d}" in n for n in names)
    durable = os.path.join(base, "durable", "step-00000003")
    assert not any(n.startswith("replica-") for n in os.listdir(durable))
    # The durable copy is an ordinary checkpoint.
    from dckpt.catalog.verify import verify_checkpoint
    assert verify_checkpoint(durable).ok

    # Restored from local: the durable copy of step 3 is corrupt and is not read.
    assert ranks(2).run(_restore, base, "durable") == [(3, "local", True)] * 2
    # One corrupt local file on one rank: every rank falls back to durable (step 3 is
    # corrupt there too, so step 2).
    assert ranks(2).run(_restore, base, "corrupt-local") == [(2, "durable", True)] * 2


def test_lost_node_and_other_world_size_restore_from_durable(ranks, tmp_path):
    base = str(tmp_path)
    ranks(2).run(_save_steps, base, [1, 2, 3])
    # Another world size: the local parts do not fit; durable, resharded 2 -> 3.
    assert ranks(3).run(_restore, base) == [(3, "durable", True)] * 3
    assert ranks(2).run(_restore, base) == [(3, "local", True)] * 2
    assert ranks(2).run(_restore, base, "wipe") == [(3, "durable", True)] * 2


def test_durable_every_steps_and_retention_per_tier(ranks, tmp_path):
    out = ranks(2).run(_save_steps, str(tmp_path), list(range(1, 13)),
                       dict(durable_every_steps=5, keep_last=2, keep_last_local=3))
    # Durable: 5 and 10 (multiples); local: the last three.
    assert out == [([5, 10], [10, 11, 12])] * 2


def _durable_failure(base: str) -> tuple:
    import dckpt

    mgr = _manager(base, keep_last_local=2)
    os.environ["DCKPT_FAULT"] = "stage:1:raise"  # the durable store fails on rank 1
    try:
        for s in (1, 2):
            assert mgr.save(s, _state(s))  # training goes on
        assert mgr.steps(tier="local") == [1, 2]
        with pytest.raises(dckpt.CheckpointError) as ei:
            mgr.wait()
    finally:
        del os.environ["DCKPT_FAULT"]
    assert mgr.steps() == []
    assert mgr.save(3, _state(3))  # the next durable save tries again, and succeeds
    mgr.wait()
    durable = mgr.steps()
    mgr.close()
    return str(ei.value), durable


def test_durable_failure_does_not_stop_training(ranks, tmp_path):
    out = ranks(2).run(_durable_failure, str(tmp_path))
    for msg, durable in out:
        assert "rank 1" in msg and "injected fault at stage" in msg, msg
        assert durable == [3]


def _async_tiers(base: str) -> tuple:
    mgr = _manager(base, async_save=True, durable_every_steps=2)
    for s in range(1, 6):
        st = _state(s)
        assert mgr.save(s, st)
        st["x"].to_local().fill_(-1)  # the snapshot is taken: changing the state is safe
    mgr.wait()
    local, durable = mgr.steps(tier="local"), mgr.steps()
    st = _state(0)
    assert mgr.restore(st) == 5 and mgr.restored_from == "local" and _same(st, _state(5))
    mgr.close()
    return local, durable


def test_async_saves_with_tiers(ranks, tmp_path):
    assert ranks(2).run(_async_tiers, str(tmp_path)) == [([5], [2, 4])] * 2


def _requested(base: str) -> list[int]:
    import dckpt

    mgr = dckpt.CheckpointManager(os.path.join(base, "d"), every_steps=100, capture_rng=False,
                                  local_root=os.path.join(base, f"n{dist.get_rank()}"))
    saved = []
    for s in range(1, 8):
        if s == 4 and dist.get_rank() == 1:
            mgr.request_save()  # an outside monitor, on one rank only
        if mgr.save(s, {"v": torch.ones(3) * s}):
            saved.append(s)
    mgr.close()
    assert mgr.steps() == saved
    return saved


def test_request_save_is_agreed_by_all_ranks(ranks, tmp_path):
    assert ranks(2).run(_requested, str(tmp_path)) == [[4]] * 2


def _tier_job_state(step: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(1024 * 1024, dtype=torch.float32).reshape(1024, 1024) + step * 1e7
    return {"w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
            "rep": torch.full((1 << 16,), float(step)), "step": step}


def _restart(root: str, rundir: str) -> tuple:
    import dckpt

    mgr = dckpt.CheckpointManager(root, every_steps=1, capture_rng=False,
                                  local_root=os.path.join(rundir, f"node{dist.get_rank()}"))
    st = _tier_job_state(0)
    step = mgr.restore(st)
    want = _tier_job_state(step)
    ok = torch.equal(st["w"].to_local(), want["w"].to_local()) and torch.equal(st["rep"], want["rep"])
    # Training goes on: the next save reaches the durable tier.
    mgr.save(step + 1, _tier_job_state(step + 1))
    mgr.close()
    return step, mgr.restored_from, ok, mgr.steps()


@pytest.mark.slow
@pytest.mark.parametrize("incremental", [False, True], ids=["raw", "incremental"])
def test_sigkill_during_staging(ranks, tmp_path, incremental):
    """The job is killed (SIGKILL, every process) while step 2 is being uploaded (raw
    byte copies, or the encoded staging of incremental durable copies): the durable tier
    still holds step 1, whole and verified, and no step 2; the restart restores step 2
    from the fast tier and the next save goes durable."""
    import time

    from .test_crash import Job, gc_after_lease

    from dckpt.catalog.verify import verify_checkpoint

    root, run = str(tmp_path / "durable"), str(tmp_path)
    # --steps 2: the job ends in close(), waiting on step 2's stuck upload, so no later
    # local save can race the kill and the restart must find step 2 exactly.
    job = Job(root, run, "--steps", "2", "--fault-step", "2", "--fault", "upload:*:sleep=60",
              *(["--incremental"] if incremental else []),
              script=os.path.join(os.path.dirname(__file__), "jobs", "tier_job.py"))
    job.wait_for("local 2")
    d2 = os.path.join(root, "step-00000002")
    end = time.time() + 60
    while time.time() < end and not any(n.startswith("data-") for n in
                                        (os.listdir(d2) if os.path.isdir(d2) else [])):
        time.sleep(0.05)  # until the upload has begun
    job.kill_all()
    job.finish()
    assert "durable 1" in "".join(job.output)
    assert sorted(n for n in os.listdir(root) if not n.startswith(".dckpt-")) == [
        "step-00000001", "step-00000002"]  # .dckpt-*: the save history
    assert "manifest.json" not in os.listdir(d2), "the killed staging became visible"
    assert any(n.startswith("data-") for n in os.listdir(d2)), "killed before the upload"
    assert verify_checkpoint(os.path.join(root, "step-00000001")).ok
    gc_after_lease(root)
    assert not os.path.exists(d2) or not os.listdir(d2)
    step, tier, ok, durable = ranks(2).run(_restart, root, run)[0]
    assert (step, tier, ok) == (2, "local", True)
    assert durable == [1, 3]


def _s3_tiers(url: str, base: str, world_saved: int) -> tuple:
    import dckpt

    mk = lambda: dckpt.CheckpointManager(url, every_steps=1, keep_last=1, capture_rng=False,  # noqa: E731
                                         local_root=os.path.join(base, f"node{dist.get_rank()}"))
    if dist.get_world_size() == world_saved:
        mgr = mk()
        for s in (1, 2, 3):
            assert mgr.save(s, _state(s))
        mgr.close()
        assert mgr.steps() == [3]  # durable retention on S3: keep_last=1
        shutil.rmtree(os.path.join(base, f"node{dist.get_rank()}"))  # every node lost
        dist.barrier()
    mgr = mk()
    st = _state(0)
    step = mgr.restore(st)
    mgr.close()
    return step, mgr.restored_from, _same(st, _state(3))


def test_fast_tier_staged_to_s3(ranks, tmp_path, s3):
    """The durable tier on a real S3-compatible server (endpoint and keys from the AWS_*
    environment, as a torchrun job gets them): staging, retention there, restore from it
    after the fast tier is gone, also at another world size."""
    from s3server import CREDENTIALS

    from dckpt.catalog.verify import verify_checkpoint

    env = dict(CREDENTIALS, AWS_ENDPOINT_URL=s3.endpoint)
    url = s3.url("tiers")
    assert ranks(2).run(_s3_tiers, url, str(tmp_path), 2, env=env, timeout=90) == [(3, "durable", True)] * 2
    assert verify_checkpoint(url + "/step-00000003", s3.options).ok
    assert ranks(3).run(_s3_tiers, url, str(tmp_path), 2, env=env, timeout=90) == [(3, "durable", True)] * 3
