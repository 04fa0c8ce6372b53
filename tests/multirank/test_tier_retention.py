"""Fast-tier housekeeping across ranks: retention after a shrink (the files of ranks that
are gone), a durable store slower than the saves (a bounded staging queue), and which
rank a failed fast-tier save names."""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist


def _state(step: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8) + step
    return {"x": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
            "rep": torch.full((8,), float(step)), "step": step}


def _tree(root: str) -> dict[str, list[str]]:
    """{step dir: sorted file names} under a local_root."""
    return {d: sorted(os.listdir(os.path.join(root, d))) for d in sorted(os.listdir(root))
            if d.startswith("step-")}


def _save(base: str, local: str, steps: list[int], kw: dict) -> tuple:
    import dckpt

    mgr = dckpt.CheckpointManager(os.path.join(base, "durable"), every_steps=1,
                                  capture_rng=False, local_root=local, **kw)
    for s in steps:
        assert mgr.save(s, _state(s))
    mgr.close()
    return mgr.steps(), mgr.steps(tier="local")


def _restore(base: str, local: str) -> tuple:
    import dckpt

    mgr = dckpt.CheckpointManager(os.path.join(base, "durable"), capture_rng=False,
                                  local_root=local)
    st = _state(0)
    step = mgr.restore(st)
    ok = torch.equal(st["x"].to_local(), _state(step)["x"].to_local())
    mgr.close()
    return step, mgr.restored_from, ok


def test_shrink_removes_the_files_of_ranks_gone(ranks, tmp_path):
    """Two ranks of one node share a local_root; then one rank goes on: retention removes
    the old steps whole, rank 1's files included (before: they stayed until reboot)."""
    base, shared = str(tmp_path), str(tmp_path / "node")
    out = ranks(2).run(_save, base, shared, [1, 2, 3], dict(keep_last_local=2))
    assert out == [([1, 2, 3], [2, 3])] * 2
    tree = _tree(shared)
    assert list(tree) == ["step-00000002", "step-00000003"]  # both ranks' files, whole
    for names in tree.values():
        assert {"manifest-00000.json", "manifest-00001.json"} <= set(names)
    # Sharing the directory costs nothing: each rank restores its own part from it.
    assert ranks(2).run(_restore, base, shared) == [(3, "local", True)] * 2

    out = ranks(1).run(_save, base, shared, [4, 5], dict(keep_last_local=1))
    assert out == [([1, 2, 3, 4, 5], [5])]
    tree = _tree(shared)
    assert list(tree) == ["step-00000005"], tree
    assert not any("-00001." in n for n in tree["step-00000005"]), tree


def test_shrink_onto_another_node_cleans_its_old_steps(ranks, tmp_path):
    """Two nodes (a local_root each); the job restarts with one rank on the second node:
    that node's steps hold only old rank 1's files, which the new rank 0 removes once
    they are beyond retention."""
    base = str(tmp_path)
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    ranks(2).run(_save_per_node, base, roots, [1, 2])
    out = ranks(1).run(_save, base, roots[1], [3], dict(keep_last_local=1))
    assert out == [([1, 2, 3], [3])]
    assert list(_tree(roots[1])) == ["step-00000003"], _tree(roots[1])
    assert list(_tree(roots[0])) == ["step-00000002"]  # nobody touches node 0's files


def _save_per_node(base: str, roots: list[str], steps: list[int]) -> tuple:
    return _save(base, roots[dist.get_rank()], steps, dict(keep_last_local=1))


def _failing_save(base: str, async_: bool) -> tuple:
    import dckpt

    mgr = dckpt.CheckpointManager(os.path.join(base, "durable"), every_steps=1,
                                  capture_rng=False, async_save=async_,
                                  local_root=os.path.join(base, f"node{dist.get_rank()}"))
    try:
        try:
            mgr.save(1, _state(1))
            mgr.wait()
        except dckpt.CheckpointError as e:
            return type(e).__name__, sorted(e.failures), str(e)
        return None
    finally:
        os.environ.pop("DCKPT_FAULT", None)
        mgr.close()


def test_fast_tier_failure_names_the_failing_rank(ranks, tmp_path):
    """A write failing on rank 1 in the fast tier is rank 1's on every rank, as
    dckpt.save reports it (before: failures == {0: ...} with a message about rank 1)."""
    for async_ in (False, True):
        out = ranks(2).run(_failing_save, str(tmp_path / str(async_)), async_,
                           env={"DCKPT_FAULT": "vote:1:raise"})
        for got in out:
            assert got is not None
            kind, failing, msg = got
            assert kind == "RankFailure" and failing == [1], got
            assert "rank 1" in msg and "injected fault at vote" in msg, msg


def _slow_store(base: str, delay: float, steps: int, forced: int) -> tuple:
    """Many quick saves into a fast tier whose durable store takes ``delay`` s per file
    written (a real file system, slowed): returns the most steps the local_root held
    after any save, the durable steps, and the log lines about skipped copies."""
    import time

    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    import dckpt

    class SlowFS(LocalFileSystem):
        """Local files, each write opened after ``delay`` s: a store slower than saves."""
        protocol = ("slowfile",)

        @classmethod
        def _strip_protocol(cls, path):  # else "slowfile:/..." is a folder in the cwd
            path = str(path)
            if path.startswith("slowfile://"):
                path = path[len("slowfile://"):]
            return super()._strip_protocol(path)

        def _open(self, path, mode="rb", **kw):
            if "w" in mode or "a" in mode:
                time.sleep(delay)
            return super()._open(path, mode, **kw)

    fsspec.register_implementation("slowfile", SlowFS, clobber=True)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    h = Keep(logging.INFO)
    logger = logging.getLogger("dckpt")
    logger.addHandler(h)
    old = logger.level
    logger.setLevel(logging.INFO)
    local = os.path.join(base, f"node{dist.get_rank()}")
    try:
        mgr = dckpt.CheckpointManager("slowfile://" + os.path.join(base, "durable"),
                                      every_steps=1, capture_rng=False, local_root=local,
                                      keep_last_local=1, keep_last=100)
        most = 0
        for s in range(1, steps + 1):
            assert mgr.save(s, _state(s), force=s == forced)
            most = max(most, len([n for n in os.listdir(local) if n.startswith("step-")]))
        mgr.close()
        durable = mgr.steps()
    finally:
        logger.removeHandler(h)
        logger.setLevel(old)
    return most, durable, [m for m in records if "skipped" in m]


def test_slow_durable_store_keeps_the_fast_tier_bounded(ranks, tmp_path):
    """Uploads slower than saves: the copies that cannot keep up are skipped (the same
    ones on every rank: no hang), the fast tier never holds more than keep_last_local
    plus the step being uploaded, and the newest step (the final save, forced) ends
    durable. Before: every queued copy kept its step, and the local_root grew."""
    out = ranks(2).run(_slow_store, str(tmp_path), 0.5, 12, 12, timeout=120)
    (most0, durable, skipped0), (most1, durable1, skipped1) = out
    assert durable == durable1
    assert most0 <= 2 and most1 <= 2, out
    assert durable[-1] == 12 and len(durable) < 12, durable
    assert skipped1 == []  # rank 0 says it, once
    missing = sorted(set(range(1, 13)) - set(durable))
    text = "\n".join(skipped0)
    assert all(f"durable copy of step {s} skipped" in text for s in missing), (missing, text)
