"""torchtitan configs for the GPU check's "titan" part: the repository's
``llama3_debugmodel_dckpt`` (launch/torchtitan_dckpt.py) and torchtitan's own
``llama3_debugmodel`` with its DCP manager, on generated assets and deterministic.

Why generated assets: the stock debug config reads ``./tests/assets`` of torchtitan's
source tree (a tokenizer and the c4_test sample), which the wheel does not ship and
the lent machine cannot download; titan.py writes a small tokenizer and dataset into
``$GPU_CHECK_TITAN_ASSETS`` instead. ``$GPU_CHECK_TITAN_STEPS`` sets the steps.
Checkpoints every 5 steps, synchronous, for both managers.
"""
from __future__ import annotations

import os
from typing import Any


def _common(config: Any) -> Any:
    assets = os.environ["GPU_CHECK_TITAN_ASSETS"]
    config.hf_assets_path = os.path.join(assets, "tokenizer")
    config.dataloader.dataset_path = os.path.join(assets, "data")
    config.training.steps = int(os.environ.get("GPU_CHECK_TITAN_STEPS", "15"))
    config.training.seq_len = 512  # a shorter sequence: the run is about checkpoints
    config.debug.seed = 42
    config.debug.deterministic = True  # a resumed run must repeat the losses exactly
    config.checkpoint.interval = 5
    config.checkpoint.enable = True
    return config


def dckpt_check() -> Any:
    """llama3_debugmodel_dckpt (DckptCheckpointManager), as launch/ defines it."""
    import launch.torchtitan_dckpt as example

    return _common(example.llama3_debugmodel_dckpt())


def dcp_check() -> Any:
    """torchtitan's llama3_debugmodel with its stock DCP CheckpointManager."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.checkpoint.keep_latest_k = 2
    return _common(config)
