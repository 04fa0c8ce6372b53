"""DckptCheckpointManager across jobs: which saved steps reach the durable folder under a
fast tier, resuming a folder that torchtitan's own DCP manager wrote, and starting a new
job from a bf16 model-only last step. Each case runs torchtitan's real components on 2
gloo ranks (tests/titankit.py), beside torchtitan's stock DCP manager where it applies."""
from __future__ import annotations

import logging
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan")

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from titankit import Parts, assert_same  # noqa: E402

DEADLINE = 240
FULL = dict(interval=2, last_save_model_only=False)


def config(which: str, **kw):
    """The manager's Config: dckpt's or torchtitan's DCP one, same fields."""
    if which == "dckpt":
        from dckpt.integrations.torchtitan import DckptCheckpointManager as cls
    else:
        from torchtitan.components.checkpointer import CheckpointManager as cls
    kw.setdefault("enable", True)
    return cls.Config(**kw)


def _strip(s: dict) -> dict:
    return {k: v for k, v in s.items() if k not in ("drawn", "loaded", "next_batch", "log")}


def _dckpt_steps(folder: str) -> list[int]:
    """The steps committed under ``folder`` (a dckpt step has its manifest)."""
    return sorted(int(d[5:]) for d in os.listdir(folder) if d.startswith("step-")
                  and os.path.exists(os.path.join(folder, d, "manifest.json")))


# ---------------------------------------------------------------- durable_interval
def _train_tiered(base: str, steps: int) -> None:
    parts = Parts(seed=0)
    local = os.path.join(base, f"node{dist.get_rank()}")
    ck = config("dckpt", interval=1, durable_interval=3, local_root=local,
                last_save_model_only=False).build(**parts.build_kwargs(base))

    def before_save(step: int) -> None:
        # Every copy queued so far finishes before the next save: a copy that cannot keep
        # up is skipped for a newer one by design (docs/TIERS.md), which a loaded machine
        # would turn into a missing durable step here.
        ck.manager.wait()

    parts.train(ck, steps, before_save=before_save)
    ck.close()


def test_durable_interval_decides_which_saved_steps_are_copied(ranks, tmp_path):
    """interval=1 saves every step to the fast tier; durable_interval=3 copies step 3
    (a multiple of it) and the last step (always) to the folder, not steps 1, 2."""
    base = str(tmp_path)
    ranks(2).run(_train_tiered, base, 4, timeout=DEADLINE)
    assert _dckpt_steps(os.path.join(base, "checkpoint")) == [3, 4]


# ---------------------------------------------------------------- a DCP folder
class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(base: str, which: str, steps: int, load_step: int = -1) -> dict:
    parts = Parts(seed=0)
    ck = config(which, **FULL).build(**parts.build_kwargs(base))
    parts.train(ck, steps, load_step=load_step)
    ck.close()
    return parts.snapshot(data=False)


def _resume(base: str, which: str, step: int = -1) -> dict:
    """Load into fresh components (another seed); the log lines of torchtitan's logger."""
    from torchtitan.tools.logging import logger

    lines, level = _Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)  # torchtitan's init_logger does so; the pool's ranks not
    try:
        parts = Parts(seed=1)
        ck = config(which, **FULL).build(**parts.build_kwargs(base))
        loaded = ck.load(step=step)
        ck.close()
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    return parts.snapshot() | {"loaded": loaded, "log": lines.lines}


def _steps_of(got: list[dict]) -> list[int]:
    return [g["train_state"]["step"] for g in got]


def test_a_folder_of_dcp_checkpoints_resumes_its_newest_step(ranks, tmp_path):
    """A run's folder holds step-2 and step-4 written by torchtitan's DCP manager, and
    the config switches to dckpt: load() resumes step 4 with everything DCP's manager
    saved (model, optimizer, scheduler, dataloader, train state), as DCP's manager
    does, and says so; load_step=2 loads DCP's step 2. A dckpt run from there saves
    steps 4 and 6 beside DCP's folders (each kept: a DCP step-4 is not a failed dckpt
    save of step 4), and 6 is then the newest; when DCP then writes step 8, that
    wins."""
    base = str(tmp_path)
    folder = os.path.join(base, "checkpoint")
    ranks(2).run(_train, base, "dcp", 4, timeout=DEADLINE)
    assert sorted(os.listdir(folder)) == ["step-2", "step-4"]
    ours = ranks(2).run(_resume, base, "dckpt", timeout=DEADLINE)
    theirs = ranks(2).run(_resume, base, "dcp", timeout=DEADLINE)
    for r in range(2):
        assert ours[r]["loaded"] is True, f"rank {r}: a DCP folder taken for a fresh start"
        assert_same(_strip(theirs[r]), _strip(ours[r]), f"rank {r}")
        assert torch.equal(ours[r]["next_batch"], theirs[r]["next_batch"]), f"rank {r}"
        assert ours[r]["train_state"] == {"step": 4, "ntokens_seen": 4 * 2 * 9}
    assert any("DCP" in line and "step-4" in line for line in ours[0]["log"]), ours[0]["log"]
    ours = ranks(2).run(_resume, base, "dckpt", 2, timeout=DEADLINE)
    theirs = ranks(2).run(_resume, base, "dcp", 2, timeout=DEADLINE)
    for r in range(2):
        assert_same(_strip(theirs[r]), _strip(ours[r]), f"load_step=2, rank {r}")
        assert ours[r]["train_state"]["step"] == 2
    # dckpt goes on from DCP's step 2 and saves steps 4 and 6 beside DCP's folders
    ranks(2).run(_train, base, "dckpt", 6, 2, timeout=DEADLINE)
    assert _dckpt_steps(folder) == [4, 6]
    assert {"step-2", "step-4"} <= set(os.listdir(folder))
    assert _steps_of(ranks(2).run(_resume, base, "dckpt", timeout=DEADLINE)) == [6, 6]
    # DCP's manager (which sees only its own steps) goes on from 4 and saves 6 and 8
    ranks(2).run(_train, base, "dcp", 8, timeout=DEADLINE)
    assert _steps_of(ranks(2).run(_resume, base, "dckpt", timeout=DEADLINE)) == [8, 8]


def _refused(base: str) -> list[str]:
    """What each manager raises resuming a folder whose newest DCP step is model-only."""
    from dckpt import CheckpointError
    from torch.distributed.checkpoint.api import CheckpointException

    got = []
    for which, error in (("dcp", CheckpointException), ("dckpt", CheckpointError)):
        parts = Parts(seed=1)
        ck = config(which, **FULL).build(**parts.build_kwargs(base))
        with pytest.raises(error) as e:
            ck.load()
        ck.close()
        got.append(str(e.value))
    return got


def test_a_model_only_dcp_last_step_is_refused_saying_how(ranks, tmp_path):
    """DCP's newest step holds only the model (last_save_model_only): DCP's manager
    fails on the missing optimizer keys, dckpt's raises a CheckpointError that says
    how to go on (a new job from it, or load_step), and load_step=2 resumes."""
    base = str(tmp_path)
    ranks(2).run(_train_model_only_last, base, timeout=DEADLINE)
    ours = ranks(2).run(_refused, base, timeout=DEADLINE)[0][1]
    assert "step-4" in ours and "initial_load_model_only=True" in ours, ours
    assert "load_step" in ours, ours
    assert _steps_of(ranks(2).run(_resume, base, "dckpt", 2, timeout=DEADLINE)) == [2, 2]


def _train_model_only_last(base: str) -> None:
    parts = Parts(seed=0)
    ck = config("dcp", interval=2).build(**parts.build_kwargs(base))  # model-only last step
    parts.train(ck, 4)
    ck.close()


def _damage_dcp(step_dir: str) -> None:
    """Truncate every data file of a DCP step (DCP keeps no checksums: a flipped bit
    would load silently; a short file does not)."""
    files = [f for f in os.listdir(step_dir) if f.endswith(".distcp")]
    assert files, os.listdir(step_dir)
    for f in files:
        os.truncate(os.path.join(step_dir, f), 64)


def test_a_damaged_newest_dcp_step_falls_back_to_the_dckpt_step_before_it(ranks, tmp_path):
    """DCP saved steps 2 and 4; dckpt resumed 4 and saved its last step 5; DCP's manager
    (which sees only its own steps) resumed 4 and saved 6. Step-6's files are damaged:
    the resume skips it, saying so, and takes the newest commit before it, dckpt's
    step 5, whole (not DCP's step-4, a lower step number)."""
    base = str(tmp_path)
    folder = os.path.join(base, "checkpoint")
    ranks(2).run(_train, base, "dcp", 4, timeout=DEADLINE)
    five = ranks(2).run(_train, base, "dckpt", 5, timeout=DEADLINE)
    ranks(2).run(_train, base, "dcp", 6, timeout=DEADLINE)
    assert _dckpt_steps(folder) == [5] and "step-6" in os.listdir(folder)
    _damage_dcp(os.path.join(folder, "step-6"))
    ours = ranks(2).run(_resume, base, "dckpt", timeout=DEADLINE)
    for r in range(2):
        assert ours[r]["train_state"]["step"] == 5, f"rank {r}"
        assert_same(_strip(five[r]), _strip(ours[r]), f"rank {r}")
    assert any("step-6" in line and "trying the next newest" in line
               for line in ours[0]["log"]), ours[0]["log"]


def test_a_rewind_to_a_dcp_step_holds_when_the_file_server_clock_is_ahead(ranks, tmp_path):
    """DCP saved steps 2..8 on a file server whose clock is an hour ahead of the
    training hosts' (the .metadata times say so); the job rewinds to DCP's step 2
    (load_step=2) and saves dckpt's step 4. The restart resumes step 4: the rewind's
    commit records the newest commit it had seen (manager.after), so it orders after
    DCP's steps whatever the clocks say, and the log names the abandoned steps."""
    base = str(tmp_path)
    folder = os.path.join(base, "checkpoint")
    ranks(2).run(_train, base, "dcp", 8, timeout=DEADLINE)
    ahead = time.time() + 3600
    for d in os.listdir(folder):
        os.utime(os.path.join(folder, d, ".metadata"), (ahead, ahead))
    ranks(2).run(_train, base, "dckpt", 4, 2, timeout=DEADLINE)
    ours = ranks(2).run(_resume, base, "dckpt", timeout=DEADLINE)
    assert _steps_of(ours) == [4, 4]
    assert any("abandoned" in line and "step-8" in line and "step-6" in line
               for line in ours[0]["log"]), ours[0]["log"]


# ---------------------------------------------------------------- bf16 last step
def _last_bf16(base: str, which: str) -> dict:
    parts = Parts(seed=0)
    ck = config(which, interval=3, export_dtype="bfloat16").build(**parts.build_kwargs(base))
    parts.train(ck, 4)  # last_save_model_only defaults to True: step 4 is the model in bf16
    ck.close()
    return parts.snapshot(data=False)


def _start_from(base: str, which: str, path: str) -> dict:
    parts = Parts(seed=1)
    ck = config(which, interval=2, initial_load_path=path,
                initial_load_model_only=True).build(**parts.build_kwargs(base))
    loaded = ck.load()
    ck.close()
    return parts.snapshot(data=False) | {"loaded": loaded}


def test_a_bf16_model_only_last_step_starts_an_fp32_job(ranks, tmp_path):
    """export_dtype="bfloat16" + last_save_model_only: a new fp32 job with
    initial_load_path=<that step>, initial_load_model_only=True loads it cast to fp32,
    as with torchtitan's DCP manager."""
    for which in ("dckpt", "dcp"):
        final = ranks(2).run(_last_bf16, str(tmp_path / which), which, timeout=DEADLINE)
        folder = tmp_path / which / "checkpoint"
        last = [d for d in os.listdir(folder) if d.startswith("step-") and int(d[5:]) == 4]
        got = ranks(2).run(_start_from, str(tmp_path / f"next-{which}"), which,
                           str(folder / last[0]), timeout=DEADLINE)
        for r in range(2):
            assert got[r]["loaded"] is True
            want = {k: v.to(torch.bfloat16).float() for k, v in final[r]["model"].items()}
            assert_same(want, got[r]["model"], f"{which} rank {r}")
            assert {v.dtype for v in got[r]["model"].values()} == {torch.float32}
            assert got[r]["train_state"] == {"step": 0, "ntokens_seen": 0}
