"""``save_model`` under FSDP ``SHARDED_STATE_DICT``: what ``from_pretrained`` loads,
without gathering the model on any rank.

Stock ``Trainer.save_model`` writes nothing in that setup (only ``FULL_STATE_DICT`` is
gathered and saved: transformers #30491). Here every rank commits its own shards of the
model to a hidden dckpt checkpoint beside ``output_dir``, and rank 0 exports it as
Hugging Face safetensors with dckpt's bounded-memory exporter (about 64 MiB of reads in
flight, whatever the model's size), then writes ``config.json``, the generation config,
the processing class (tokenizer) and ``training_args.json`` (no pickle) as stock's
``_save`` would; the hidden checkpoint is removed."""
from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from ...protocol.collectives import Comm, agree, on_rank0
from ...protocol.commit import save
from ..common.place import remove_whole
from ..common.states import ModelState

log = logging.getLogger(__name__)
ARGS_FILE = "training_args.json"
TEMP = ".dckpt-model-"  # the hidden checkpoint an export reads, beside output_dir


def sharded(trainer: Any) -> bool:
    """Whether ``trainer`` trains under FSDP with a sharded state dict type (the setup
    stock ``save_model`` leaves without weights). No I/O."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return False
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return plugin is not None and "FULL_STATE_DICT" not in str(plugin.state_dict_type)


def save_sharded_model(trainer: Any, output_dir: str) -> None:
    """Write ``trainer.model`` to ``output_dir`` as HF safetensors + ``config.json``
    (+ generation config, processing class, training_args.json). Weight files already
    there are replaced; other files are kept. Collective (every rank writes its shards;
    the outcome is agreed). Blocking I/O: the model's bytes written twice (the shards,
    then the export on rank 0, which reads them back once). Raises the same
    CheckpointError on every rank (the save's, the export's or a writer's)."""
    comm = Comm()
    out = os.path.abspath(os.path.expanduser(os.fspath(output_dir)))

    def decide() -> str:
        parent, name = os.path.split(out)
        os.makedirs(parent or ".", exist_ok=True)
        for n in os.listdir(parent or "."):  # a killed export's temporary checkpoint
            if n.startswith(f".{name}{TEMP}"):
                remove_whole(os.path.join(parent, n))
        return os.path.join(parent, f".{name}{TEMP}{uuid.uuid4().hex[:12]}")

    tmp = on_rank0(comm, decide, f"plan the model export to {out}")
    try:
        save({"model": ModelState(trainer.model)}, tmp)
        err = None
        if comm.rank == 0:
            try:
                _export(trainer, tmp, out)
            except Exception as e:
                err = e
        agree(comm, err, f"export the model to {out}")
    finally:
        if comm.rank == 0:
            try:
                remove_whole(tmp)
            except OSError as e:  # a leftover hidden folder, never the export
                log.warning("could not remove the temporary checkpoint %s: %s", tmp, e)


def _export(trainer: Any, ckpt: str, out: str) -> None:
    """Rank 0: the export and the files stock ``_save`` writes beside the weights."""
    from ...interop.hf_export import export

    info = export(ckpt, out, prefix="model.", overwrite=True)
    model = trainer.accelerator.unwrap_model(trainer.model)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(out)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained") and getattr(
            model, "can_generate", lambda: False)():
        gen.save_pretrained(out)
    proc = trainer.processing_class
    if proc is None:
        proc = getattr(getattr(trainer, "data_collator", None), "tokenizer", None)
    if proc is not None and hasattr(proc, "save_pretrained"):
        proc.save_pretrained(out)
    with open(os.path.join(out, ARGS_FILE), "w", encoding="utf-8") as f:
        f.write(trainer.args.to_json_string())
    log.info("save_model: %d tensors (%.1f MiB) exported to %s without a gather",
             info.tensors, info.bytes / 2**20, out)
