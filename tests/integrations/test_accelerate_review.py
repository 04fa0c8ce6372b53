"""Adversarial review of the Accelerate adapter (DckptAccelerator, issue 45 part 1), one
process (real Accelerate, CPU, no torch.distributed; one real subprocess for the exit
status). Each test is a defect found on 268075f, fixed with this test.
The multi-rank cases are in tests/multirank/test_accelerate_review.py."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from .hf_helpers import fresh_accelerate_state  # noqa: E402,F401 (autouse)

import dckpt  # noqa: E402


def make(project_dir=None, *, auto=False, total_limit=None, async_save=False, model=None):
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    from dckpt.integrations.accelerate import DckptAccelerator

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    kw = {}
    if project_dir is not None:
        kw["project_config"] = ProjectConfiguration(
            project_dir=str(project_dir), automatic_checkpoint_naming=auto,
            total_limit=total_limit)
    acc = DckptAccelerator(cpu=True, async_save=async_save, **kw)
    torch.manual_seed(0)
    m = model if model is not None else nn.Linear(2, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m, o = acc.prepare(m, o)
    return acc, m, o


def test_save_to_an_existing_folder_keeps_what_else_is_in_it(tmp_path):
    """Stock save_state(output_dir) writes its files into the folder (makedirs
    exist_ok) and leaves the rest alone; scripts call ``accelerator.save_state(
    args.output_dir)`` next to the tokenizer, logs and the final model, or
    save_state(project_dir) with the checkpoints under it. DckptAccelerator renames
    its staged checkpoint over the folder and removes the old one whole: the user's
    files (and any checkpoints under it) are gone. Nothing but total_limit may delete
    a checkpoint; a foreign folder must be refused (CheckpointError naming it) or
    kept."""
    out = tmp_path / "outputs"
    (out / "checkpoints" / "checkpoint_0").mkdir(parents=True)
    (out / "tokenizer.json").write_text("{}")
    (out / "checkpoints" / "checkpoint_0" / "model.safetensors").write_bytes(b"x")
    acc, _, _ = make()
    try:
        acc.save_state(str(out))
    except dckpt.CheckpointError as e:  # refusing the foreign folder is a fix too
        assert str(out) in str(e)
    assert (out / "tokenizer.json").exists(), sorted(os.listdir(out))
    assert (out / "checkpoints" / "checkpoint_0" / "model.safetensors").exists()


def test_resume_past_a_damaged_newest_can_save_again(tmp_path):
    """The promise: a resume falls back past a damaged newest checkpoint and the job
    goes on. Here it resumes checkpoint_0, sets iteration = 1, and its next
    save_state() raises ValueError because the damaged checkpoint_1 still holds the
    name (the existing multirank test stops before saving again). The same happens
    after a rewind (load_state(checkpoint_0) with checkpoint_1 present). Fix: with
    automatic naming, the next iteration is past every checkpoint_<i> name present."""
    acc, m, _ = make(tmp_path / "p", auto=True)
    acc.save_state()
    acc.save_state()
    c1 = tmp_path / "p" / "checkpoints" / "checkpoint_1"
    f = next(p for p in c1.iterdir() if p.name.endswith(".safetensors"))
    data = bytearray(f.read_bytes())
    data[-8] ^= 0xFF
    f.write_bytes(bytes(data))
    acc, m, _ = make(tmp_path / "p", auto=True)
    acc.load_state()  # warns, loads checkpoint_0
    assert acc.project_configuration.iteration >= 1
    where = acc.save_state()  # ValueError: checkpoint_1 already exists
    assert os.path.basename(where) != "checkpoint_1"


EXIT_JOB = textwrap.dedent("""
    import os, sys, torch
    from torch import nn
    from accelerate.utils import ProjectConfiguration
    from dckpt.integrations.accelerate import DckptAccelerator
    acc = DckptAccelerator(cpu=True, async_save=True, project_config=ProjectConfiguration(
        project_dir=sys.argv[1], automatic_checkpoint_naming=True))
    m = nn.Linear(2, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m, o = acc.prepare(m, o)
    os.environ["DCKPT_FAULT"] = "commit:0:raise"
    acc.save_state()
    print("last save returned; the script ends (no end_training)", flush=True)
""")


def test_failed_last_async_save_fails_the_process(tmp_path):
    """end_training() is optional in Accelerate (it only closes trackers); a script
    whose last ``save_state()`` with async_save fails exits 0 with no checkpoint: the
    error is only logged at exit. The Lightning/Fabric adapters fail the process
    (integrations/common/exit.py: watch); the shared Committer now does too."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DCKPT_FAULT", None)
    r = subprocess.run([sys.executable, "-c", EXIT_JOB, str(tmp_path / "p")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert "last save returned" in r.stdout, r.stdout + r.stderr
    assert not [n for n in os.listdir(tmp_path / "p" / "checkpoints")
                if not n.startswith(".")]  # nothing committed
    assert r.returncode != 0, r.stdout + r.stderr[-2000:]


def test_async_save_of_a_batchnorm_model_survives_the_next_forward(tmp_path, monkeypatch):
    """Issue 45: 'save_state returns after the snapshot'. The adapter fences only the
    optimizers (tree.fence_targets), not the models (the Lightning adapters fence the
    module too), so a forward that updates BatchNorm's running stats while the copy
    still runs makes the save fail ('written in place') at the next
    save_state/end_training. A slow copy (a big model on a busy host) is simulated by
    delaying the background copy by 1 s. The same holds for a registered object's or
    scheduler's live tensors (rank 0's objects are not copied at the call)."""
    from dckpt.engine import staging

    run = staging.StagingPool.run

    def slow(*a, **k):
        time.sleep(1.0)
        return run(*a, **k)

    monkeypatch.setattr(staging.StagingPool, "run", staticmethod(slow))
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    acc, m, _ = make(async_save=True, model=model)
    m.train()
    m(torch.randn(8, 4))
    saved_mean = m[1].running_mean.clone()
    path = acc.save_state(str(tmp_path / "x"))
    m(torch.randn(8, 4))  # the next step's forward
    acc.end_training()  # CheckpointError: 'models.0.1.num_batches_tracked' changed
    acc2, m2, _ = make(model=nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    acc2.load_state(path)
    assert torch.equal(m2[1].running_mean, saved_mean)


def test_hostile_deep_object_skeleton_is_a_checkpoint_error(tmp_path, monkeypatch):
    """codec.decode json.loads the (untrusted) skeleton before its 200-level depth
    check and catches only ValueError/TypeError/KeyError: 100,000 nested '[' (200 KB,
    well under the manifest cap) escape as RecursionError, outside every agreement
    (on a multi-rank load each rank raises it on its own) and not fallback-worthy."""
    from dckpt.integrations.common import tree

    class Obj:
        def state_dict(self):
            return {"a": 1}

        def load_state_dict(self, sd):
            pass

    build = tree.build

    def hostile(c, rank, key):
        t = build(c, rank, key)
        t["objects"]["custom_0"]["doc"] = "[" * 100_000 + "]" * 100_000
        return t

    monkeypatch.setattr(tree, "build", hostile)
    acc, _, _ = make()
    acc.register_for_checkpointing(Obj())
    path = acc.save_state(str(tmp_path / "x"))
    monkeypatch.setattr(tree, "build", build)
    acc, _, _ = make()
    acc.register_for_checkpointing(Obj())
    with pytest.raises(dckpt.CheckpointError, match="custom_0"):
        acc.load_state(path)


def test_dckpt_folder_without_manifest_is_not_committed(tmp_path):
    """Issue 45: 'NotCommittedError (a path with nothing committed)'. A folder holding
    dckpt data files but no manifest (its manifest lost, or copied before the commit)
    is taken for a stock checkpoint and handed to Accelerate's load_state, which fails
    with FileNotFoundError 'pytorch_model.bin'. The data-*.safetensors names (or the
    save intent) say it is dckpt's: NotCommittedError naming the folder."""
    acc, _, _ = make()
    path = acc.save_state(str(tmp_path / "x"))
    os.remove(os.path.join(path, "manifest.json"))
    acc, _, _ = make()
    with pytest.raises(dckpt.NotCommittedError, match="x"):
        acc.load_state(path)


def test_object_store_rotation_never_removes_the_checkpoint_just_saved(tmp_path):
    """Issue 45: total_limit 'never removes the one just saved'. to_remove protects
    ``keep`` by string equality, and resolve.committed_in builds object-store paths as
    f"{scheme}://{fs.ls(...)}": memory's ls answers '/proj/checkpoints/checkpoint_0',
    so the listed path is 'memory:///proj/...' while plan.final is 'memory://proj/...'.
    Nothing is protected then: with total_limit=1 and an older checkpoint whose commit
    time is later than now (written by a host whose clock ran ahead), the rotation
    deletes the checkpoint just saved, and the job's newest state is gone. On a local
    path the same scenario keeps the new one."""
    import dataclasses

    import fsspec

    from dckpt.format import manifest as mf

    fs = fsspec.filesystem("memory")
    base = f"/acc-review-{tmp_path.name}"
    acc, _, _ = make(f"memory://{base.lstrip('/')}", auto=True, total_limit=1)
    acc.save_state()
    p = f"{base}/checkpoints/checkpoint_0/manifest.json"
    m = mf.parse(fs.cat(p), p)
    fs.pipe(p, mf.to_json(dataclasses.replace(m, created=time.time() + 600)))
    where = acc.save_state()
    try:
        left = [n.rstrip("/").rsplit("/", 1)[-1]
                for n in fs.ls(f"{base}/checkpoints", detail=False)]
        assert where.endswith("checkpoint_1")
        assert "checkpoint_1" in left, left
    finally:
        fs.rm(base, recursive=True)


def test_hostile_step_in_the_metadata_is_a_checkpoint_error(tmp_path, monkeypatch):
    """_load_one does int(meta['step']) and int(meta['iteration']) on the untrusted
    metadata after the models, optimizers and objects were loaded, outside any
    agreement: a non-number raises ValueError/TypeError (each rank on its own), and the
    accelerator is left half-restored. The metadata's fields must be checked with the
    rest in check() (before any byte is read): a CheckpointError naming the field."""
    from dckpt.integrations.accelerate import contents

    meta = contents.meta

    def hostile(acc, saved):
        return {**meta(acc, saved), "step": "x"}

    monkeypatch.setattr(contents, "meta", hostile)
    acc, _, _ = make()
    path = acc.save_state(str(tmp_path / "x"))
    monkeypatch.setattr(contents, "meta", meta)
    acc, _, _ = make()
    with pytest.raises(dckpt.CheckpointError, match="step"):
        acc.load_state(path)
