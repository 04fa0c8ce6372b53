"""Adversarial review of a13925b (the torchtitan adapter resuming a folder that mixes
torchtitan's DCP steps with dckpt's) and b9b0cbc (bytes values over 64 KiB stored in
data files), at 2 gloo ranks. Each test states what the promise requires."""
from __future__ import annotations

import glob
import logging
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

DEADLINE = 240
FULL = dict(interval=2, last_save_model_only=False)


# ---------------------------------------------------------------- bytes values
def _save_per_rank_bytes(path: str, sizes: tuple[int, ...]) -> str:
    """Every rank saves its own bytes value under one shared key (each rank's pickled
    sampler position, say) of ``sizes[rank]`` bytes; returns the error, if any."""
    import dckpt

    r = dist.get_rank()
    try:
        dckpt.save({"sampler": bytes([r + 1]) * sizes[r], "w": torch.ones(2)}, path)
    except dckpt.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return ""


@pytest.mark.parametrize("sizes", [(60 << 10, 70 << 10), (70 << 10, 80 << 10)],
                         ids=["straddling-64KiB", "both-over-64KiB"])
def test_a_shared_bytes_key_of_different_sizes_saves_as_small_ones_do(ranks, tmp_path, sizes):
    """A bytes value under one key that differs between ranks saves, as it always did
    (the lowest rank's value, with a warning, as for every other value): 100 and 200
    bytes save, and so did 60 KiB and 70 KiB before b9b0cbc (inline up to 1 MiB). Now,
    once one rank's value crosses 64 KiB the save fails on every rank: "key 'sampler'
    is a tensor on one rank and a plain value on another" (it is bytes on both), or
    "ranks disagree about tensor 'sampler': rank 0 has dtype U8 shape [71680] ...". A
    job whose per-rank blob grows past 64 KiB can no longer checkpoint at all."""
    import dckpt

    small = ranks(2).run(_save_per_rank_bytes, str(tmp_path / "small"), (100, 200),
                         timeout=DEADLINE)
    assert small == ["", ""], small
    assert dckpt.open(str(tmp_path / "small"))["sampler"] == b"\x01" * 100
    big = str(tmp_path / "big")
    got = ranks(2).run(_save_per_rank_bytes, big, sizes, timeout=DEADLINE)
    assert got == ["", ""], got[0]
    assert dckpt.open(big)["sampler"] == b"\x01" * sizes[0]  # the lowest rank's, as small


# ---------------------------------------------------------------- torchtitan: DCP steps
def config(which: str, **kw):
    if which == "dckpt":
        from dckpt.integrations.torchtitan import DckptCheckpointManager as cls
    else:
        from torchtitan.components.checkpointer import CheckpointManager as cls
    kw.setdefault("enable", True)
    return cls.Config(**kw)


def _train(base: str, which: str, steps: int, load_step: int = -1,
           until: int | None = None) -> int:
    from titankit import Parts

    parts = Parts(seed=0)
    ck = config(which, **FULL).build(**parts.build_kwargs(base))
    parts.train(ck, steps, load_step=load_step, until=until)
    ck.close()
    return parts.train_state.step


def _resume(base: str) -> int:
    """The step a fresh dckpt manager resumes (its train_state), or the error."""
    from titankit import Parts

    parts = Parts(seed=1)
    ck = config("dckpt", **FULL).build(**parts.build_kwargs(base))
    try:
        ck.load()
    finally:
        ck.close()
    return parts.train_state.step


def _damage(step_dir: str) -> None:
    """Flip bytes in the middle of every data file of a dckpt step (checksummed)."""
    files = glob.glob(os.path.join(step_dir, "data-*.safetensors"))
    assert files, os.listdir(step_dir)
    for f in files:
        size = os.path.getsize(f)
        with open(f, "r+b") as fh:
            fh.seek(size - 64)
            b = fh.read(32)
            fh.seek(size - 64)
            fh.write(bytes(x ^ 0xFF for x in b))


def test_a_damaged_newest_dckpt_step_falls_back_past_a_newer_dcp_step(ranks, tmp_path):
    """The folder holds dckpt's step 2, DCP's steps 2 and 4 (torchtitan's DCP manager
    ran after it), and dckpt's step 6 (dckpt resumed DCP's step 4). Step 6's data is
    damaged: the newest complete checkpoint that loads is DCP's step 4, and the
    adapter's own rule (the newest step of the folder by step number, DCP's or
    dckpt's) says so. The adapter hands the choice to CheckpointManager.restore, whose
    fallback sees only dckpt's steps: the job silently resumes step 2, losing two
    steps of training that step 4 holds."""
    base = str(tmp_path)
    folder = os.path.join(base, "checkpoint")
    ranks(2).run(_train, base, "dckpt", 2, timeout=DEADLINE)
    ranks(2).run(_train, base, "dcp", 4, timeout=DEADLINE)
    assert {"step-2", "step-4", "step-00000002"} <= set(os.listdir(folder))
    ranks(2).run(_train, base, "dckpt", 6, timeout=DEADLINE)
    assert os.path.exists(os.path.join(folder, "step-00000006", "manifest.json"))
    _damage(os.path.join(folder, "step-00000006"))
    got = ranks(2).run(_resume, base, timeout=DEADLINE)
    assert got == [4, 4], f"resumed step {got} with DCP's step-4 intact and newer"


def test_a_rewind_to_a_dcp_step_is_not_undone_by_the_next_restart(ranks, tmp_path):
    """DCP's manager saved steps 2..8; the job switches to dckpt and rewinds with
    load_step=2 (past a loss spike, say), trains and saves step 4, and is killed. The
    restart must resume step 4, the job's newest checkpoint (dckpt's Timelines
    guarantee: a restore never picks a step committed before an older one was; a
    dckpt-only folder removes the abandoned steps 6 and 8 after step 4 commits). It
    resumes DCP's step-8 of the abandoned timeline: the rewind is silently undone."""
    base = str(tmp_path)
    ranks(2).run(_train, base, "dcp", 8, timeout=DEADLINE)
    assert ranks(2).run(_train, base, "dckpt", 10, 2, 4, timeout=DEADLINE) == [4, 4]
    got = ranks(2).run(_resume, base, timeout=DEADLINE)
    assert got == [4, 4], f"resumed step {got} after a rewind to 2 and a save of 4"
