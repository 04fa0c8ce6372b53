"""torchtitan trainer configs that checkpoint with dckpt (torchtitan >= 0.3.0).

torchtitan's configs are Python functions returning a ``Trainer.Config``; these take
torchtitan's own llama3 configs and swap the checkpoint manager for dckpt's
:class:`dckpt.integrations.torchtitan.DckptCheckpointManager`, keeping every
checkpoint field the stock config sets (interval, last_save_model_only, ...).

Install (on the GPU nodes): ``pip install "dckpt[torchtitan]"``. Train on one node
with 8 GPUs, from this repository's root (torchtitan finds the module by its
dotted path)::

    PYTHONPATH=. torchrun --nproc-per-node=8 -m torchtitan.train \\
        --module launch.torchtitan_dckpt --config llama3_8b_dckpt \\
        --hf_assets_path ./assets/hf/Llama-3.1-8B --dump_folder /shared/runs/llama3-8b

Every option stays a command-line flag (``--checkpoint.interval 200``,
``--checkpoint.local_root /local_nvme/dckpt``). Kill the job at any moment and run
the same command again, on any number of GPUs: it resumes from the newest step that
committed. ``dckpt ls /shared/runs/llama3-8b/checkpoint`` lists the steps and
``dckpt verify`` checks one. The small ``llama3_debugmodel_dckpt`` runs on one GPU
(``--nproc-per-node=1``) in a minute. torchtitan's llama3 needs CUDA (triton).
"""
from __future__ import annotations

from dckpt.integrations.torchtitan import DckptCheckpointManager


def llama3_8b_dckpt():
    """torchtitan's llama3_8b, checkpointed by dckpt: async saves every 500 steps into
    the node-local fast tier (when ``--checkpoint.local_root`` is given; every 4th
    also to the shared folder), the newest 3 kept."""
    from torchtitan.models.llama3.config_registry import llama3_8b

    config = llama3_8b()
    config.checkpoint = DckptCheckpointManager.Config.from_config(
        config.checkpoint, enable=True, async_mode="async", keep_latest_k=3)
    return config


def llama3_8b_dckpt_local():
    """As :func:`llama3_8b_dckpt`, with the fast tier on each node's NVMe and one
    replica of each node's files on another node."""
    config = llama3_8b_dckpt()
    config.checkpoint.local_root = "/local_nvme/dckpt"
    config.checkpoint.durable_interval = 4
    config.checkpoint.replicas = 1
    return config


def llama3_debugmodel_dckpt():
    """torchtitan's debug model (one GPU, a minute), saving every 5 steps."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.checkpoint = DckptCheckpointManager.Config.from_config(
        config.checkpoint, enable=True, interval=5, keep_latest_k=2)
    return config
