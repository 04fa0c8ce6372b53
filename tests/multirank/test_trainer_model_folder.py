"""Every Trainer checkpoint is a model folder, at real gloo ranks (torchrun): DDP at 2
ranks (side files: the model's bytes written once) and FSDP2 at 2 ranks through the CPU
shim (the ranks' background export, index last), each next to the stock Trainer in
the same test: ``from_pretrained("out/checkpoint-N")`` holds the model at step N; the
tokenizer loads; ``dckpt verify`` passes; a kill during the background export leaves a
checkpoint that resumes and a folder ``from_pretrained`` refuses, which the resume
writes again. Job script: tests/multirank/jobs/trainer_job.py."""
from __future__ import annotations

import os

import pytest
import torch

from .test_trainer import ckpts, run

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _model_at(out, step: int) -> dict:
    return torch.load(os.path.join(os.path.dirname(out), "refs", f"save-{step}-r0.pt"),
                      weights_only=False)["model"]


def _loads(ck) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ck)).state_dict()


def _equal(got: dict, want: dict) -> bool:
    return all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("impl", ["stock", "dckpt"])
def test_ddp_checkpoints_load_with_from_pretrained(tmp_path, impl):
    from transformers import AutoTokenizer

    out = tmp_path / impl / "out"
    run(out, impl, 2, "--steps", "4", "--every", "2", "--tokenizer")
    for step in (2, 4):
        ck = out / f"checkpoint-{step}"
        assert _equal(_loads(ck), _model_at(str(out), step)), (impl, step)
        assert AutoTokenizer.from_pretrained(str(ck))("w3 w5")["input_ids"] == [3, 5]
        if impl == "dckpt":
            from dckpt.catalog.verify import verify_checkpoint

            assert verify_checkpoint(str(ck)).ok
            assert "model.safetensors" not in os.listdir(ck)  # the side files, once


def test_fsdp2_checkpoints_load_with_from_pretrained(tmp_path):
    from dckpt.catalog.verify import verify_checkpoint

    stock = tmp_path / "stock" / "out"
    run(stock, "stock", 2, "--steps", "2", "--every", "2", "--fsdp")
    # stock's SHARDED_STATE_DICT checkpoint: no model folder (not even its config)
    with pytest.raises((OSError, ValueError)):
        _loads(stock / "checkpoint-2")
    out = tmp_path / "dckpt" / "out"
    run(out, "dckpt", 2, "--steps", "4", "--every", "2", "--limit", "1", "--fsdp",
        "--tokenizer")
    assert ckpts(out) == ["checkpoint-4"]  # rotation removed the whole older folder
    ck = out / "checkpoint-4"
    names = os.listdir(ck)
    assert "model.safetensors.index.json" in names
    assert sum(n.endswith("-of-00002.safetensors") for n in names) == 2, names
    assert _equal(_loads(ck), _model_at(str(out), 4))
    assert verify_checkpoint(str(ck)).ok
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(ck))("w3 w5")["input_ids"] == [3, 5]


def test_kill_during_the_background_export_resumes_and_rewrites_the_folder(tmp_path):
    out = tmp_path / "out"
    run(out, "dckpt", 2, "--steps", "6", "--every", "2", "--fsdp", "--kill-in-export", "4",
        ok=False)
    ck = out / "checkpoint-4"
    assert (ck / "manifest.json").exists()
    assert "model.safetensors.index.json" not in os.listdir(ck)
    with pytest.raises(OSError):
        _loads(ck)  # refused, never a partial model
    text = run(out, "dckpt", 2, "--steps", "6", "--every", "2", "--fsdp", "--resume")
    assert "RESUMED step=4" in text, text[-3000:]
    # written again by the resume (the killed run's refs of step 4 may be missing:
    # the resume's record of what it loaded is the model at step 4)
    resumed = torch.load(os.path.join(tmp_path, "refs", "resumed-2-r0.pt"),
                         weights_only=False)["model"]
    assert _equal(_loads(ck), resumed)
    assert _equal(_loads(out / "checkpoint-6"), _model_at(str(out), 6))


def test_fsdp2_with_the_fast_tier_exports_each_durable_copy(tmp_path):
    """``local_root``: a save commits in the node-local tier and its durable copy lands
    later; once it is placed, the ranks export the model folder from it (the end of
    ``train()`` waits for the copies and the last export)."""
    out = tmp_path / "out"
    run(out, "dckpt", 2, "--steps", "4", "--every", "2", "--fsdp", "--local-root",
        str(tmp_path / "local"))
    for step in (2, 4):
        ck = out / f"checkpoint-{step}"
        assert "model.safetensors.index.json" in os.listdir(ck), sorted(os.listdir(ck))
        assert _equal(_loads(ck), _model_at(str(out), step))
