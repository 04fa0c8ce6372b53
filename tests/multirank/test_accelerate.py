"""DckptAccelerator with real Accelerate on gloo CPU ranks (torchrun), FSDP2 through
the CPU shim, next to the stock Accelerator in the same scenarios (issue 45).
Job script: tests/multirank/jobs/accelerate_job.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .lightning_run import run_cmd, torchrun  # noqa: E402
from .staterefs import ref, same_state  # noqa: E402

pytest.importorskip("accelerate")

JOB = os.path.join(os.path.dirname(__file__), "jobs", "accelerate_job.py")
PHASES = ["plan", "write", "commit", "place", "rotate"]  # before the first write ...
# ... mid-write, before the commit, committed but not renamed, during rotation


def run(root, impl: str, n: int | None, *args: str, ok: bool = True, timeout: float = 150) -> str:
    """torchrun ``n`` ranks of the job (``n`` None: one plain process, ``--roots``)
    under a deadline, the whole session reaped; must exit 0 when ``ok``."""
    cmd = torchrun(JOB, n) + ["--impl", impl] + (
        ["--root", str(root)] if root is not None else []) + list(args)
    rc, out = run_cmd(cmd, timeout)
    if ok:
        assert rc == 0, out[-4000:]
    return out


def same(a: dict, b: dict) -> bool:
    """Model, optimizer, scheduler, registered object, step and iteration equal."""
    return same_state(a, b, ("sched", "counter", "counter_rank", "step", "iteration"))


def ckpts(root) -> list[str]:
    """The names a user (or stock load_state) sees; dckpt's staging is hidden."""
    return sorted(n for n in os.listdir(os.path.join(root, "p", "checkpoints"))
                  if not n.startswith("."))


def no_pickle(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for f in files:
            assert f.endswith((".safetensors", ".json")), os.path.join(dirpath, f)


def verify(path: str) -> None:
    r = subprocess.run([sys.executable, "-m", "dckpt", "verify", path], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_save_at_2_resume_at_3_and_1_rotation_naming_and_a_damaged_newest(tmp_path):
    root = tmp_path
    run(root, "dckpt", 2, "--steps", "6", "--every", "2", "--total-limit", "2")
    assert ckpts(root) == ["checkpoint_1", "checkpoint_2"]  # total_limit, in commit order
    for c in ckpts(root):
        no_pickle(os.path.join(root, "p", "checkpoints", c))
        verify(os.path.join(root, "p", "checkpoints", c))
    saved = [ref(root, f"save-6-r{r}") for r in range(2)]
    # 3 ranks: everything equal to what rank r mod 2 saved; iteration = saved + 1
    out = run(root, "dckpt", 3, "--steps", "8", "--every", "2", "--total-limit", "2",
              "--resume")
    assert "RESUMED step=6 iteration=3 counter=6" in out
    got = [ref(root, f"resumed-3-r{r}") for r in range(3)]
    for r in range(3):
        assert same(got[r], saved[0]), r  # the registered object: rank 0's copy
    assert got[0]["probe"] == saved[0]["probe"] and got[1]["probe"] == saved[1]["probe"]
    assert got[2]["probe"] not in (saved[0]["probe"], saved[1]["probe"])  # derived stream
    # the next save after the resume is checkpoint_3 (stock: checkpoint_0), rotation after
    assert ckpts(root) == ["checkpoint_2", "checkpoint_3"]
    # 1 rank: the newest committed checkpoint (saved at 3 ranks)
    run(None, "dckpt", None, "--roots", str(root), "--steps", "8", "--resume")
    one = ref(root, "resumed-1-r0")
    assert same(one, ref(root, "save-8-r0")) and one["probe"] == ref(root, "save-8-r0")["probe"]
    # a damaged newest checkpoint: skipped with a warning, the one before it loads
    d = os.path.join(root, "p", "checkpoints", "checkpoint_3")
    f = next(os.path.join(d, n) for n in sorted(os.listdir(d)) if n.endswith(".safetensors"))
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) - 8)
        b = fh.read(1)
        fh.seek(os.path.getsize(f) - 8)
        fh.write(bytes([b[0] ^ 0xFF]))
    out = run(None, "dckpt", None, "--roots", str(root), "--steps", "6", "--resume")
    # the next automatic name is past the damaged checkpoint_3, which keeps its name
    assert "checkpoint_3 could not be loaded" in out and "RESUMED step=6 iteration=4" in out
    resumed = ref(root, "resumed-1-r0")
    assert resumed["iteration"] == 4  # past checkpoint_3; the rest is checkpoint_2's
    assert same({**resumed, "iteration": saved[0]["iteration"]}, saved[0])


def test_sigkill_in_each_phase_of_a_save_resumes_the_newest_complete_one(tmp_path):
    """Saves at steps 2 and 4, total_limit=1, every rank SIGKILLed in the save of step
    4 at each phase. dckpt: the restart resumes step 2 (step 4 when the kill came during
    rotation, after its name appeared). Stock, killed mid-save: its rotation already
    deleted checkpoint_0 before writing, and load_state() picks the half-written
    checkpoint_1 and fails."""
    roots = []
    for phase in PHASES:
        root = tmp_path / phase
        out = run(root, "dckpt", 2, "--steps", "4", "--every", "2", "--total-limit", "1",
                  "--kill-at", "4", "--phase", phase, ok=False)
        assert "SAVED 4" not in out, out[-3000:]
        names = ckpts(root)
        if phase == "rotate":
            assert "checkpoint_1" in names  # placed: complete
        else:
            assert names == ["checkpoint_0"], (phase, names)  # no half-written name
        roots.append(root)
    out = run(None, "dckpt", None, "--roots", ",".join(map(str, roots)), "--steps", "4",
              "--resume")
    for phase, root in zip(PHASES, roots):
        got = ref(root, "resumed-1-r0")
        if phase == "rotate":  # the killed save's own step (no ref was recorded for it)
            assert (got["step"], got["counter"], got["iteration"]) == (4, 4, 2)
            assert not same(got, ref(root, "save-2-r0"))
        else:
            assert same(got, ref(root, "save-2-r0")), phase
    # stock, same scenario, killed after its FSDP model and optimizer files are written
    stock = tmp_path / "stock"
    run(stock, "stock", 2, "--steps", "4", "--every", "2", "--total-limit", "1",
        "--kill-at", "4", "--phase", "hook", ok=False)
    assert ckpts(stock) == ["checkpoint_1"]  # checkpoint_0 deleted before the write
    out = run(stock, "stock", 2, "--steps", "4", "--resume", ok=False)
    assert "RESUMED" not in out  # it picked the half-written folder and failed


def test_a_rank_that_raises_in_save_fails_every_rank_and_places_nothing(tmp_path):
    out = run(tmp_path, "dckpt", 2, "--steps", "4", "--every", "2", "--raise-rank", "1",
              "--raise-at", "4", ok=False)
    assert out.count("SAVE FAILED") == 2 and "failed on rank 1" in out, out[-3000:]
    assert ckpts(tmp_path) == ["checkpoint_0"]


def test_stock_folder_migrates_then_async_saves_resume(tmp_path):
    run(tmp_path, "stock", 2, "--steps", "2", "--every", "2")
    assert ckpts(tmp_path) == ["checkpoint_0"]
    # dckpt loads the stock folder (super().load_state), then saves asynchronously
    out = run(tmp_path, "dckpt", 2, "--steps", "6", "--every", "2", "--resume",
              "--async-save", "--total-limit", "2")
    assert "RESUMED step=2 iteration=1 counter=2" in out
    assert same(ref(tmp_path, "resumed-2-r0"), ref(tmp_path, "save-2-r0"))
    # rotation counts committed dckpt checkpoints only: the stock folder is left alone
    assert ckpts(tmp_path) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    no_pickle(os.path.join(tmp_path, "p", "checkpoints", "checkpoint_2"))
    run(None, "dckpt", None, "--roots", str(tmp_path), "--steps", "6", "--resume")
    assert same(ref(tmp_path, "resumed-1-r0"), ref(tmp_path, "save-6-r0"))


def _losses(text: str) -> dict[int, str]:
    return {int(ln.split()[1]): ln.split()[2] for ln in text.splitlines()
            if ln.startswith("LOSS ")}


@pytest.mark.parametrize("impl", ["dckpt", "stock"])
def test_a_resume_repeats_the_uninterrupted_losses_bit_for_bit(tmp_path, impl):
    """FSDP2 at 2 ranks, the data drawn from each rank's RNG: 6 steps in one run, and 4
    steps then load_state() and 2 more: the resumed steps' losses are the uninterrupted
    run's, bitwise (model, optimizer, scheduler and RNG all restored), for
    DckptAccelerator as for the stock Accelerator."""
    whole = _losses(run(tmp_path / "whole", impl, 2, "--steps", "6", "--every", "2"))
    run(tmp_path / "cut", impl, 2, "--steps", "4", "--every", "2")
    # no save after the resume: stock's would fail (its iteration restarts at 0 and
    # checkpoint_0 exists, accelerate #3306); this test is about the restored state
    rest = _losses(run(tmp_path / "cut", impl, 2, "--steps", "6", "--every", "100",
                       "--resume"))
    assert sorted(whole) == [1, 2, 3, 4, 5, 6] and sorted(rest) == [5, 6], (whole, rest)
    assert all(rest[s] == whole[s] for s in (5, 6)), (rest, whole)
