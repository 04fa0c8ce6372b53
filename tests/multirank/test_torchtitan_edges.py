"""Issue 36 review: DckptCheckpointManager driven as torchtitan's Trainer and a user
would, at its edges (rewinds, partial steps, settings that differ between ranks, async
saves racing the next step, close/save order, injected I/O errors, resource growth).
Real gloo ranks (tests/harness.py), real files, deadlines."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan")

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from titankit import Parts, assert_same  # noqa: E402

DEADLINE = 180


def _cfg(**kw):
    from dckpt.integrations.torchtitan import DckptCheckpointManager

    kw.setdefault("enable", True)
    kw.setdefault("last_save_model_only", False)
    return DckptCheckpointManager.Config(**kw)


def _kind(e: BaseException) -> str:
    """"CheckpointError" for dckpt's errors (any subclass), else the type's name."""
    from dckpt import CheckpointError

    return "CheckpointError" if isinstance(e, CheckpointError) else type(e).__name__


def _strip(s: dict) -> dict:
    return {k: v for k, v in s.items() if k not in ("drawn", "loaded", "next_batch")}


# ------------------------------------------------------------------ rewind

def _rewind(base: str) -> dict:
    parts = Parts(seed=0)
    ck = _cfg(interval=2).build(**parts.build_kwargs(base))
    parts.train(ck, 20, until=6)  # steps 2, 4, 6 saved
    ck.close()
    # rewind: load step 2, train again to step 4 (other data: another seed's batches
    # would differ, so perturb the model), save step 4 again
    again = Parts(seed=1)
    ck = _cfg(interval=2).build(**again.build_kwargs(base))
    assert ck.load(step=2)
    with torch.no_grad():
        for p in again.model.parameters():
            p.add_(0.5)
    while again.train_state.step < 4:  # the Trainer's loop, without its load()
        again.train_state.step += 1
        again.train_step(ck)
        ck.save(again.train_state.step)
    at4 = _strip(again.snapshot(data=False))
    ck.close()
    dist.barrier()
    back = Parts(seed=2)
    ck = _cfg(interval=2).build(**back.build_kwargs(base))
    assert ck.load()
    got = _strip(back.snapshot(data=False))
    ck.close()
    return {"at4": at4, "got": got}


def test_rewind_and_resave_the_same_step(ranks, tmp_path):
    """save 2, 4, 6; load(step=2); train; save 4 again: a resume gets the new step 4
    (not the abandoned 6, nor the old 4)."""
    out = ranks(2).run(_rewind, str(tmp_path), timeout=DEADLINE)
    for r in range(2):
        assert out[r]["got"]["train_state"]["step"] == 4
        assert_same(out[r]["at4"], out[r]["got"], f"rank {r}")


# ------------------------------------------------------------------ partial steps

def _partial(base: str) -> dict:
    parts = Parts(seed=0)
    ck = _cfg(interval=2).build(**parts.build_kwargs(base))
    parts.train(ck, 20, until=4)
    ck.close()
    dist.barrier()
    folder = os.path.join(base, "checkpoint")
    step4 = [d for d in os.listdir(folder) if d.startswith("step-") and int(d[5:]) == 4][0]
    if dist.get_rank() == 0:  # a crashed save of step 4: files, no manifest
        for f in os.listdir(os.path.join(folder, step4)):
            if "manifest" in f:
                os.remove(os.path.join(folder, step4, f))
    dist.barrier()
    back = Parts(seed=1)
    ck = _cfg(interval=2).build(**back.build_kwargs(base))
    err = None
    try:
        ck.load(step=4)
    except FileNotFoundError:
        err = "FileNotFoundError"
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    latest = ck.load()
    step = back.train_state.step
    ck.close()
    return {"err": err, "latest": latest, "step": step}


def test_load_of_a_partly_written_step(ranks, tmp_path):
    out = ranks(2).run(_partial, str(tmp_path), timeout=DEADLINE)
    for r in range(2):
        assert out[r]["err"] == "FileNotFoundError", out[r]
        assert out[r]["latest"] is True and out[r]["step"] == 2, out[r]


# ------------------------------------------------------------------ settings that differ

def _differ(base: str, field: str, values: list) -> str:
    parts = Parts(seed=0)
    kw = {field: values[dist.get_rank()]}
    try:
        ck = _cfg(**kw).build(**parts.build_kwargs(base))
    except Exception as e:  # noqa: BLE001
        return f"{_kind(e)}: {e}"
    ck.close()
    return "built"


@pytest.mark.parametrize("field,values", [
    ("interval", [2, 3]),
    ("keep_latest_k", [2, 3]),
    ("last_save_model_only", [True, False]),
    ("export_dtype", ["float32", "bfloat16"]),
    ("exclude_from_loading", [[], ["lr_scheduler"]]),
    ("async_mode", ["disabled", "async"]),
])
def test_settings_that_differ_between_ranks_are_one_clear_error(ranks, tmp_path, field, values):
    """A setting that makes the ranks save, keep or load differently (one rank would
    enter a collective save the others skip: a hang) is refused at construction, the
    same CheckpointError on every rank."""
    out = ranks(2).run(_differ, str(tmp_path), field, values, timeout=DEADLINE)
    for r in range(2):
        assert out[r].startswith("CheckpointError") and field in out[r], out


# ------------------------------------------------------------------ close / save order

def _after_close(base: str, mode: str) -> dict:
    parts = Parts(seed=0)
    ck = _cfg(interval=2, async_mode=mode).build(**parts.build_kwargs(base))
    parts.train(ck, 20, until=2)
    ck.close()
    ck.close()  # twice: a no-op
    refused = None
    try:
        ck.save(4)
    except Exception as e:  # noqa: BLE001
        refused = _kind(e)
    ck.close()
    committed = ck.manager.steps()
    return {"refused": refused, "steps": committed}


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_save_after_close_is_refused_or_flushed(ranks, tmp_path, mode):
    """save() after close(): either a clear CheckpointError, or the save is committed
    once close() returns again (never an async save left behind)."""
    out = ranks(2).run(_after_close, str(tmp_path / mode), mode, timeout=DEADLINE)
    for r in range(2):
        assert out[r]["refused"] == "CheckpointError" or 4 in out[r]["steps"], out[r]


def _failed_then_close(base: str) -> dict:
    parts = Parts(seed=0)
    ck = _cfg(interval=2).build(**parts.build_kwargs(base))
    os.environ["DCKPT_FAULT"] = "write:1:raise"
    try:
        with pytest.raises(Exception) as ei:
            parts.train(ck, 20, until=2)
    finally:
        del os.environ["DCKPT_FAULT"]
    first = _kind(ei.value)
    errs = []
    for _ in range(2):
        try:
            ck.close()
        except Exception as e:  # noqa: BLE001
            errs.append(_kind(e))
    return {"first": first, "close": errs}


def test_close_after_a_failed_save(ranks, tmp_path):
    out = ranks(2).run(_failed_then_close, str(tmp_path), timeout=DEADLINE)
    for r in range(2):
        assert out[r]["first"] == "CheckpointError", out[r]
        assert out[r]["close"] == [], out[r]  # already reported by save()


# ------------------------------------------------------------------ async vs the next step

def _async_buffer(base: str) -> dict:
    """A model whose forward writes a persistent buffer in place (BatchNorm's running
    stats; an MoE's load counters): the next step's forward runs right after the
    async save() returns, while the copy is still going."""
    from dckpt.engine import staging

    parts = Parts(seed=0)
    model = parts.model
    model.register_buffer("seen", torch.zeros(4))

    def count(module, args) -> None:  # in place, inside the forward
        model.seen.add_(1)

    model.norm.register_forward_pre_hook(count)
    slow = staging.StagingPool.__dict__["run"]

    def run(*a, **k):
        time.sleep(1.0)  # a large state on a slow host: the copy takes a while
        return slow.__func__(*a, **k)

    staging.StagingPool.run = staticmethod(run)
    try:
        ck = _cfg(interval=2, async_mode="async").build(**parts.build_kwargs(base))
        at = {}
        parts.train(ck, 20, until=3,
                    before_save=lambda s: at.setdefault(s, model.seen.clone()))
        err = None
        try:
            ck.maybe_wait_for_saving()
            ck.close()
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
    finally:
        staging.StagingPool.run = slow
    if err is not None:
        return {"err": err}
    import dckpt

    with dckpt.open(ck.manager.path(2)) as c:
        saved = c.get_tensor("state.model.seen")
    return {"err": None, "at_call": at[2], "saved": saved}


def test_async_save_holds_buffers_the_next_forward_writes(ranks, tmp_path):
    out = ranks(2).run(_async_buffer, str(tmp_path), timeout=DEADLINE)
    for r in range(2):
        assert out[r]["err"] is None, out[r]["err"]
        assert torch.equal(out[r]["at_call"], out[r]["saved"]), out[r]


# ------------------------------------------------------------------ injected I/O errors

def _eio_restore(base: str) -> dict:
    parts = Parts(seed=0)
    ck = _cfg(interval=2).build(**parts.build_kwargs(base))
    parts.train(ck, 20, until=4)
    ck.close()
    back = Parts(seed=1)
    ck = _cfg(interval=2).build(**back.build_kwargs(base))
    os.environ["DCKPT_FAULT"] = "load:1:raise"
    err = None
    try:
        ck.load()
    except Exception as e:  # noqa: BLE001
        err = _kind(e)
    finally:
        del os.environ["DCKPT_FAULT"]
    step_after = back.train_state.step
    ck.close()
    return {"err": err, "step": step_after}


def test_transient_io_error_in_restore_is_an_error_not_an_older_step(ranks, tmp_path):
    """An EIO while restoring the newest step raises a CheckpointError on every rank;
    it never silently resumes an older step (whose next save would drop the newer)."""
    out = ranks(2).run(_eio_restore, str(tmp_path), timeout=DEADLINE)
    for r in range(2):
        assert out[r]["err"] == "CheckpointError", out[r]


# ------------------------------------------------------------------ another world size

def _resize(base: str, save: bool) -> dict:
    parts = Parts(seed=0)
    ck = _cfg(interval=2).build(**parts.build_kwargs(base))
    if save:
        parts.train(ck, 20, until=2)
        ck.close()
        return {}
    try:
        ck.load()
        err = None
    except Exception as e:  # noqa: BLE001
        err = f"{_kind(e)}: {e}"
    ck.close()
    return {"err": err}


def test_resume_at_another_world_size_with_the_dataloader(ranks, tmp_path):
    """torchtitan's dataloader state is per dp rank ({"dp_rank_<r>": bytes,
    "world_size": N}); a resume at 3 ranks of a 2-rank save (the dataloader not
    excluded) is a clear error on every rank (DCP's: a missing key), not a raw
    AssertionError/KeyError from inside the dataloader on some ranks."""
    ranks(2).run(_resize, str(tmp_path), True, timeout=DEADLINE)
    out = ranks(3).run(_resize, str(tmp_path), False, timeout=DEADLINE)
    for r in range(3):
        assert out[r]["err"] is not None and out[r]["err"].split(":")[0] in (
            "CheckpointError", "StateMismatchError", "ValueError"), out


# ------------------------------------------------------------------ growth

def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _many(base: str, mode: str, n: int) -> dict:
    parts = Parts(seed=0)
    ck = _cfg(interval=1, async_mode=mode, keep_latest_k=2).build(**parts.build_kwargs(base))
    parts.train(ck, 10_000, until=5)
    ck.maybe_wait_for_saving()
    t0, f0 = threading.active_count(), _fds()
    parts.train(ck, 10_000, until=5 + n)
    ck.maybe_wait_for_saving()
    time.sleep(0.5)
    t1, f1 = threading.active_count(), _fds()
    ck.close()
    return {"threads": (t0, t1), "fds": (f0, f1),
            "dirs": sorted(os.listdir(os.path.join(base, "checkpoint")))}


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_many_saves_do_not_grow_threads_or_fds(ranks, tmp_path, mode):
    out = ranks(2).run(_many, str(tmp_path / mode), mode, 45, timeout=DEADLINE)
    for r in range(2):
        (t0, t1), (f0, f1) = out[r]["threads"], out[r]["fds"]
        assert t1 <= t0 + 2, out[r]
        assert f1 <= f0 + 4, out[r]


# ------------------------------------------------------------------ model-only last step

def _model_only_last(base: str) -> dict:
    parts = Parts(seed=0)
    kw = dict(interval=2, keep_latest_k=2, last_save_model_only=True)
    ck = _cfg(**kw).build(**parts.build_kwargs(base))
    parts.train(ck, 8)  # 2, 4, 6 full; 8 the model only
    ck.close()
    dirs = sorted(d for d in os.listdir(os.path.join(base, "checkpoint")) if d.startswith("step-"))
    back = Parts(seed=1)
    ck = _cfg(**kw).build(**back.build_kwargs(base))  # the run extended: resume
    try:
        ck.load()
        err = None
    except Exception as e:  # noqa: BLE001
        err = f"{_kind(e)}: {e}"
    out = {"dirs": dirs, "err": err, "step": back.train_state.step,
           "lr": back.lr_schedulers.state_dict()["last_epoch"]}
    ck.close()
    return out


def test_resume_when_the_newest_step_is_model_only(ranks, tmp_path):
    """keep_latest_k=2 and a model-only last step: a resume never loads the model of
    step 8 with a fresh optimizer/scheduler/train state as if that were a full
    resume; it is a clear CheckpointError (DCP's: missing keys) or the full step 6."""
    out = ranks(2).run(_model_only_last, str(tmp_path), timeout=DEADLINE)
    for r in range(2):
        o = out[r]
        assert (o["err"] is not None and o["err"].startswith("CheckpointError")) or \
            (o["step"] == 6 and o["lr"] == 6), o
