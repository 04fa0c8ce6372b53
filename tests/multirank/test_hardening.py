"""A failing rank never hangs or confuses the others (hardening issue, items 5-7 and 9).

Every multi-rank call here runs under a short deadline: before the fixes these hung
until the process-group timeout (30 min), so a regression fails in seconds.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from harness import RankFailed

DEADLINE = 40.0  # seconds; each of these calls takes well under 5 s when it works


def _state() -> dict:
    return {"w": torch.arange(16.0) + dist.get_rank(), "step": 3}


def _bad_value_on_rank1(path: str, use_async: bool) -> str:
    import dckpt

    sd = {"w": torch.ones(4)}
    if dist.get_rank() == 1:
        sd["note"] = 10 ** 5000  # no JSON can hold it
    try:
        if use_async:
            dckpt.async_save(sd, path).result(timeout=DEADLINE)
        else:
            dckpt.save(sd, path)
    except dckpt.UnsupportedValueError as e:
        assert "note" in str(e) and "rank 1" in str(e), str(e)
        assert not os.path.exists(os.path.join(path, "manifest.json"))
        return str(e)
    raise AssertionError("the save did not fail")


@pytest.mark.parametrize("use_async", [False, True])
def test_plan_error_on_one_rank_reaches_every_rank(ranks, tmp_path, use_async):
    out = ranks(2).run(_bad_value_on_rank1, str(tmp_path / "c"), use_async, timeout=DEADLINE)
    assert out[0] == out[1]


def _plan_encoding_fails_on_rank1(path: str) -> str:
    """Whatever fails while a rank encodes its plan (not only what flatten refuses)
    travels through the gather."""
    import dckpt
    from dckpt.layout import localplan

    real = localplan.encode
    calls = []

    def broken(plan):
        calls.append(1)
        if dist.get_rank() == 1 and len(calls) == 1:
            raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")
        return real(plan)

    localplan.encode = broken
    try:
        dckpt.save({"w": torch.ones(4)}, path)
    except dckpt.RankFailure as e:
        assert "rank 1" in str(e) and "4300 digits" in str(e), str(e)
        return str(e)
    finally:
        localplan.encode = real
    raise AssertionError("the save did not fail")


def test_plan_encoding_error_travels(ranks, tmp_path):
    out = ranks(2).run(_plan_encoding_fails_on_rank1, str(tmp_path / "c"), timeout=DEADLINE)
    assert out[0] == out[1]


def _rank0_listing_fails(root: str) -> list[str]:
    import dckpt

    mgr = dckpt.CheckpointManager(root, capture_rng=False)
    mgr.save(1, _state(), force=True)
    errors = []
    if dist.get_rank() == 0:
        def denied(path):
            raise PermissionError(13, "Permission denied", path)
        mgr.storage.listdir = denied
    for call in (mgr.steps, lambda: mgr.restore(_state())):
        try:
            call()
        except dckpt.RankFailure as e:
            assert "Permission denied" in str(e) and "rank 0" in str(e), str(e)
            errors.append(str(e))
            continue
        raise AssertionError("no error")
    return errors


def test_manager_rank0_failures_reach_every_rank(ranks, tmp_path):
    out = ranks(2).run(_rank0_listing_fails, str(tmp_path / "run"), timeout=DEADLINE)
    assert out[0] == out[1] and len(out[0]) == 2


def _async_then_destroy(path: str, init_file: str) -> int:
    """async_save, then destroy_process_group before result(): the save's own group
    lives on, so every rank gets the same committed result; the job can re-init."""
    import dckpt

    rank, world = dist.get_rank(), dist.get_world_size()
    h = dckpt.async_save(_state(), path)
    dist.destroy_process_group()
    info = h.result(timeout=DEADLINE)
    assert info.world_size == world
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    t = {"w": torch.zeros(16), "step": 0}
    dckpt.load(t, path)  # "w" differed per rank: the lowest rank's value was saved
    assert torch.equal(t["w"], torch.arange(16.0)) and t["step"] == 3
    return len([n for n in os.listdir(path) if n.endswith(".safetensors")])


def test_async_save_survives_destroy_process_group(ranks, tmp_path):
    out = ranks(2).run(_async_then_destroy, str(tmp_path / "c"), str(tmp_path / "reinit"),
                       timeout=DEADLINE)
    assert out == [1, 1]  # rank 0 wrote the replicated tensors; no orphan file


def _collective_times_out(path: str) -> str:
    """A save over a group whose other rank never joins: the timeout surfaces as a
    CommunicationError naming the collective, not a raw DistBackendError."""
    import datetime
    import time

    import dckpt

    g = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(4)  # never joins the save
        return "absent"
    try:
        dckpt.save(_state(), path, process_group=g)
    except dckpt.CommunicationError as e:
        assert "collective" in str(e) and "gather" in str(e), str(e)
        return type(e).__name__
    raise AssertionError("no error")


def test_collective_timeout_is_a_checkpoint_error(ranks, tmp_path):
    out = ranks(2).run(_collective_times_out, str(tmp_path / "c"), timeout=DEADLINE)
    assert out == ["CommunicationError", "absent"]


def _restore_skips_malformed_manifest(root: str) -> int:
    """A newest manifest that is valid JSON but not a manifest (a number too large for
    a float) is skipped identically on every rank; the older step is restored."""
    import dckpt

    mgr = dckpt.CheckpointManager(root, capture_rng=False)
    mgr.save(1, {"w": torch.full((4,), 1.0)}, force=True)
    mgr.save(2, {"w": torch.full((4,), 2.0)}, force=True)
    dist.barrier()
    if dist.get_rank() == 0:
        import json

        from dckpt.format.manifest import seal

        p = os.path.join(mgr.path(2), "manifest.json")
        doc = json.loads(open(p, "rb").read())
        doc["created"] = 10 ** 400  # resealed: the checksum holds, the value does not
        open(p, "wb").write(seal(doc))
    dist.barrier()
    t = {"w": torch.zeros(4)}
    step = mgr.restore(t)
    assert torch.equal(t["w"], torch.full((4,), 1.0))
    return step


def test_restore_skips_a_malformed_manifest_on_every_rank(ranks, tmp_path):
    assert ranks(2).run(_restore_skips_malformed_manifest, str(tmp_path / "run"),
                        timeout=DEADLINE) == [1, 1]


def _peer_killed_mid_save(path: str) -> str:
    import dckpt

    try:
        dckpt.save(_state(), path)
    except dckpt.CommunicationError as e:
        return "CommunicationError"
    except Exception as e:  # the point of the test: no raw torch error
        raise AssertionError(f"{type(e).__name__}: {e}")
    raise AssertionError("no error")


def test_peer_killed_mid_save_gives_communication_error(ranks, tmp_path):
    """Rank 1 is SIGKILLed after writing its file; rank 0 gets a CommunicationError
    within the deadline, and nothing is committed."""
    pool = ranks(2)
    with pytest.raises(RankFailed) as info:
        pool.run(_peer_killed_mid_save, str(tmp_path / "c"), timeout=DEADLINE,
                 env={"DCKPT_FAULT": "vote:1:kill"})
    msg = str(info.value)
    assert "rank 0: ok" in msg and "dead: [1]" in msg, msg
    assert not os.path.exists(tmp_path / "c" / "manifest.json")
