"""Adversarial review of the model folder at real gloo ranks (torchrun, FSDP2 through
the CPU shim): a rewind that saves checkpoint-N again. Job script:
tests/multirank/jobs/trainer_job.py."""
from __future__ import annotations

import os

import pytest
import torch

from .lightning_run import job_env, run_cmd, torchrun
from .test_trainer import JOB, run

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def test_resaved_sharded_checkpoint_never_loads_the_replaced_folders_weights(tmp_path):
    """FSDP2 at 2 ranks: checkpoint-4 and its model folder; the run rewinds to
    checkpoint-2 and trains to 4 again (attention dropout on: other weights at step 4);
    every rank is killed as the new checkpoint-4's export starts. checkpoint-4 then
    holds the new save; its model folder must not load (no index) or load the new
    save's weights, never the replaced folder's."""
    from safetensors.torch import load_file

    from dckpt.integrations.common.modelfolder import check_loadable
    from dckpt.interop import export

    out = tmp_path / "out"
    run(out, "dckpt", 2, "--steps", "4", "--every", "2", "--fsdp")
    ck = out / "checkpoint-4"
    assert "model.safetensors.index.json" in os.listdir(ck)
    old = {}
    for n in os.listdir(ck):
        if n.endswith("-of-00002.safetensors"):
            old.update(load_file(str(ck / n)))
    env = dict(job_env(), DCKPT_FAULT="export-start:*:kill")
    cmd = torchrun(JOB, 2) + ["--impl", "dckpt", "--out", str(out), "--steps", "4",
                              "--every", "2", "--fsdp", "--losses",
                              "--resume", str(out / "checkpoint-2")]
    rc, text = run_cmd(cmd, 150, env)
    assert rc != 0 and "RESUMED step=2" in text, text[-3000:]
    truth = tmp_path / "truth"
    export(str(ck), str(truth), prefix="models.0.")  # the committed save's model
    new = load_file(str(truth / "model.safetensors"))
    assert any(not torch.equal(new[k], old[k]) for k in new)  # the rewind changed them
    if not check_loadable(str(ck)):  # the folder claims to be complete
        got = {}
        for n in os.listdir(ck):
            if n.endswith("-of-00002.safetensors"):
                got.update(load_file(str(ck / n)))
        assert all(torch.equal(got[k], new[k]) for k in new), \
            "checkpoint-4's model folder holds the replaced run's weights"
