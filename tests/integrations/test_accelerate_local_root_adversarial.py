"""Adversarial review of DckptAccelerator(local_root=...) (the fast tier), one process
(real Accelerate, CPU). Each test pins a defect the review proved on f277e0b (it failed
there), fixed since."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")

from .test_accelerate_local_root import make, state, train  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate_state(monkeypatch):
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.delenv("DCKPT_FAULT", raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def equal(m, want: dict) -> bool:
    return all(torch.equal(v, want[k]) for k, v in m.state_dict().items())


def unreachable_s3():
    import socket

    pytest.importorskip("s3fs")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}


def save_with_failed_copy(acc, monkeypatch) -> str:
    """A save whose local commit succeeds and whose durable copy fails (an injected
    OSError in the staging: the store went away mid-copy); waits for the copy."""
    monkeypatch.setenv("DCKPT_FAULT", "stage:*:raise")
    try:
        where = acc.save_state()
        acc._dckpt_tier.drain()
    finally:
        monkeypatch.delenv("DCKPT_FAULT", raising=False)
    return where


# --------------------------------------------------------------------- save hooks
def unet_hooks(acc, seen: dict):
    """The diffusers pattern: the save hook writes a model's files under
    ``output_dir/unet`` (and pops its weights); the load hook reads them back from
    ``input_dir/unet``."""

    def save_hook(models, weights, output_dir):
        os.makedirs(os.path.join(output_dir, "unet"), exist_ok=True)
        with open(os.path.join(output_dir, "unet", "config.json"), "w") as f:
            f.write('{"step": %d}' % acc.step)

    def load_hook(models, input_dir):
        p = os.path.join(input_dir, "unet", "config.json")
        seen["dir"] = input_dir
        seen["unet"] = open(p).read() if os.path.exists(p) else None

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)


def test_load_hooks_see_the_save_hooks_files_of_a_fast_tier_only_checkpoint(
        tmp_path, monkeypatch):
    proj, local = str(tmp_path / "p"), str(tmp_path / "local")
    acc, m, o = make(proj, local)
    seen: dict = {}
    unet_hooks(acc, seen)
    train(acc, m, o)
    save_with_failed_copy(acc, monkeypatch)  # checkpoint_0: fast tier only
    want = state(m)
    acc.end_training()
    acc, m, o = make(proj, local)
    unet_hooks(acc, seen)
    acc.load_state()
    assert equal(m, want) and acc.step == 1  # resumed from the fast tier ...
    assert seen["unet"] == '{"step": 1}', seen  # ... with the hook's files at input_dir


def test_store_down_a_save_with_a_pre_hook_still_commits_in_the_fast_tier(
        tmp_path, monkeypatch):
    from dckpt import CheckpointError

    # the durable store is "down": the project folder cannot be created or listed
    (tmp_path / "mnt").write_text("not mounted")
    proj, local = str(tmp_path / "mnt" / "p"), str(tmp_path / "local")
    acc, m, o = make(proj, local)
    # without a hook the fast tier takes the save (the documented promise)
    train(acc, m, o)
    acc.save_state()
    acc, m, o = make(proj, local)
    unet_hooks(acc, {})
    train(acc, m, o)
    try:
        acc.save_state()
    except (CheckpointError, OSError) as e:
        pytest.fail(f"save_state with a pre-hook failed while the store is down: {e!r}")


# ---------------------------------------------------------------- transient read
def test_a_transient_view_read_error_never_rewinds_to_an_older_checkpoint(
        tmp_path, monkeypatch):
    from dckpt import CheckpointError
    from dckpt.integrations.common import slots

    proj, local = str(tmp_path / "p"), str(tmp_path / "local")
    acc, m, o = make(proj, local)
    train(acc, m, o)
    acc.save_state()  # checkpoint_0: copied
    acc._dckpt_tier.drain()
    train(acc, m, o)
    save_with_failed_copy(acc, monkeypatch)  # checkpoint_1: fast tier only (newest)
    acc.end_training()
    assert os.path.isdir(os.path.join(proj, "checkpoints", "checkpoint_0"))
    assert not os.path.exists(os.path.join(proj, "checkpoints", "checkpoint_1"))

    real_mine, failed = slots.mine, []

    def flaky_mine(storage, slot, final, comm):
        real_read = storage.read_file

        def read_file(path, *a, **kw):
            if not failed and final.endswith("checkpoint_1") and \
                    os.path.basename(path).startswith("manifest-"):
                failed.append(path)
                raise OSError(5, "Input/output error (transient)")
            return real_read(path, *a, **kw)

        storage.read_file = read_file
        try:
            return real_mine(storage, slot, final, comm)
        finally:
            del storage.read_file

    monkeypatch.setattr(slots, "mine", flaky_mine)
    acc, m, o = make(proj, local)
    try:
        acc.load_state()
    except CheckpointError:
        return  # refusing is acceptable; a silent rewind is not
    assert failed, "the fault was not injected"
    assert acc.step == 2, f"resumed step {acc.step}: an older checkpoint, silently"


# ---------------------------------------------------------- total_limit, store down
def test_store_down_total_limit_still_bounds_the_fast_tier(tmp_path):
    opts = unreachable_s3()
    proj, local = "s3://nowhere/proj", str(tmp_path / "local")
    acc, m, o = make(proj, local, total_limit=2, options=opts)
    for _ in range(5):
        train(acc, m, o)
        acc.save_state()
    acc.end_training()
    slots_left = os.listdir(local)
    assert len(slots_left) <= 2, f"{len(slots_left)} slots for total_limit=2: {slots_left}"


# ------------------------------------------------- a name a save may not replace
def test_a_folder_holding_a_users_files_keeps_them_with_local_root_too(tmp_path):
    """Stock save_state writes into an existing folder and leaves the rest alone: the
    user's files there are kept in the placed checkpoint, without and with the fast
    tier (whose copy places the name later)."""
    for local in (None, str(tmp_path / "local")):
        out = tmp_path / ("model_out" if local is None else "model_out_tier")
        out.mkdir()
        (out / "tokenizer.json").write_text("{}")
        acc, m, o = make(str(tmp_path / "p"), local, auto=False)
        train(acc, m, o)
        try:
            acc.save_state(str(out))
        finally:
            if acc._dckpt_tier is not None:
                acc._dckpt_tier.drain()
        assert (out / "tokenizer.json").read_text() == "{}"  # never deleted
        assert (out / "manifest.json").exists()
        acc.load_state(str(out))


# ------------------------------------------- total_limit before the new local commit
def test_async_total_limit_removes_nothing_before_the_new_local_commit(tmp_path, monkeypatch):
    import time

    proj, local = str(tmp_path / "p"), str(tmp_path / "local")
    acc, m, o = make(proj, local, total_limit=1, async_save=True)
    train(acc, m, o)
    acc.save_state()  # checkpoint_0
    acc._dckpt_tier.drain()
    ck0 = os.path.join(proj, "checkpoints", "checkpoint_0")
    assert os.path.isdir(ck0)
    train(acc, m, o)
    monkeypatch.setenv("DCKPT_FAULT", "vote:*:sleep=3")  # a slow local write of checkpoint_1
    try:
        acc.save_state()  # returns after the snapshot
        time.sleep(1.5)  # checkpoint_1's local commit is still in flight (a kill here ...)
        slot0 = any(os.path.isdir(os.path.join(local, s)) and os.listdir(os.path.join(local, s))
                    and s == os.path.basename(acc._dckpt_tier.slot(ck0)) for s in os.listdir(local))
        durable0 = os.path.isdir(ck0)
        slot1 = acc._dckpt_tier.slot(os.path.join(proj, "checkpoints", "checkpoint_1"))
        in_flight = not (os.path.isdir(slot1) and any(
            n.startswith("manifest-") for n in os.listdir(slot1)))
    finally:
        acc._dckpt_tier.drain()
        monkeypatch.delenv("DCKPT_FAULT", raising=False)
    assert in_flight, "checkpoint_1's local commit was not in flight at the check"
    # ... must find checkpoint_0 somewhere: it is the only complete checkpoint
    assert durable0 or slot0, "checkpoint_0 removed (durable and local) before checkpoint_1 committed"
