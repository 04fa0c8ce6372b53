"""Issue 36: DckptCheckpointManager's Config and construction, in one process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torchtitan")

from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager  # noqa: E402

from dckpt.integrations.torchtitan import DckptCheckpointManager  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_config_builds_the_dckpt_manager():
    cfg = DckptCheckpointManager.Config(enable=False)
    assert isinstance(cfg, BaseCheckpointManager.Config)
    assert type(cfg)._owner is DckptCheckpointManager  # else build() makes DCP's
    m = cfg.build(dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None,
                  states={}, sd_adapter=None)
    assert isinstance(m, DckptCheckpointManager)
    assert m.load() is False and m.save(10) is False  # disabled: torchtitan's base
    m.close()


def test_from_config_keeps_the_stock_fields():
    stock = CheckpointManager.Config(enable=True, interval=7, keep_latest_k=4,
                                     last_save_model_only=False, export_dtype="bfloat16",
                                     async_mode="async_with_pinned_mem",
                                     exclude_from_loading=["dataloader"])
    cfg = DckptCheckpointManager.Config.from_config(stock, local_root="/nvme", replicas=1)
    assert (cfg.interval, cfg.keep_latest_k, cfg.last_save_model_only, cfg.export_dtype,
            cfg.exclude_from_loading) == (7, 4, False, "bfloat16", ["dataloader"])
    assert cfg.async_mode == "async_with_pinned_mem" and cfg.local_root == "/nvme"


@pytest.mark.parametrize("kw, what", [
    (dict(async_mode="sometimes"), "async_mode"),
    (dict(durable_interval=2), "local_root"),
    (dict(replicas=1), "local_root"),
    (dict(local_root="/x", replicas=-1), "negative"),
    (dict(compression="gzip"), "compression"),
    (dict(durable_interval=0, local_root="/x"), "durable_interval"),
    (dict(keep_latest_k=1), "at least 2"),  # torchtitan's own rule, kept
    (dict(interval=0), "interval"),
])
def test_bad_config_is_a_value_error(kw, what):
    with pytest.raises(ValueError, match=what):
        DckptCheckpointManager.Config(enable=True, **kw)


def test_last_save_in_hf_needs_an_adapter(tmp_path):
    cfg = DckptCheckpointManager.Config(enable=True, last_save_in_hf=True)
    with pytest.raises(ValueError, match="sd_adapter"):
        cfg.build(dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None,
                  states={}, sd_adapter=None, base_folder=str(tmp_path))


def test_importing_dckpt_never_imports_torchtitan():
    code = ("import sys, dckpt, dckpt.integrations; dckpt.CheckpointManager; "
            "assert 'torchtitan' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_launch_example_names_the_dckpt_manager():
    """torchtitan's llama3 needs triton (no CPU build): the example's functions are
    checked for what they select, not run."""
    sys.path.insert(0, ROOT)
    try:
        import launch.torchtitan_dckpt as example
    finally:
        sys.path.remove(ROOT)
    for name in ("llama3_8b_dckpt", "llama3_8b_dckpt_local", "llama3_debugmodel_dckpt"):
        assert callable(getattr(example, name))
    assert example.DckptCheckpointManager is DckptCheckpointManager
