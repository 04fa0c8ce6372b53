"""``DckptAccelerator.load_state``'s work: which checkpoint to load (an explicit folder,
the newest committed ``checkpoint_<i>``, the fast tier's), loading it into the
accelerator's models, optimizers and registered objects, and where the run goes on
(the next ``checkpoint_<i>``, the timeline). Functions of the accelerator, split from
:mod:`.accelerator` to keep each module to one job."""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable

from accelerate.utils import DistributedType

from ...errors import NotCommittedError
from ...protocol.collectives import Comm, agree, on_rank0
from ..common import fast, resolve, tree
from ..common.place import dckpt_leftover, is_url, join, kind
from . import contents as cn
from . import ds as dsa

# the accelerator's logger: a user's level or handler on it covers loads too
log = logging.getLogger(__name__.rsplit(".", 1)[0] + ".accelerator")
NAME = re.compile(r"checkpoint_[0-9]+")


def checkpoints_dir(acc: Any) -> str:
    """Where automatic naming puts ``checkpoint_<i>``. Pure."""
    return join(acc.project_dir, "checkpoints")


def load(acc: Any, input_dir: str | None, load_kwargs: dict | None, stock_load: Callable,
         **load_model_func_kwargs: Any) -> None:
    """The body of ``DckptAccelerator.load_state`` after its argument checks: ``stock_load`` is
    ``accelerate.Accelerator.load_state`` bound to ``acc`` (a folder of stock files goes
    there). Collective; blocking I/O; raises as ``load_state`` documents."""
    comm = Comm()
    acc._dckpt_agree(comm)
    acc._dckpt.finish()
    opts = acc._dckpt.storage_options
    tier = acc._dckpt_tier
    if tier is not None:
        acc._dckpt_rotation_fast.flush()
    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if tier is not None:  # the name's fast-tier commit, or its durable copy
            choices = fast.one(tier, input_dir, opts)
            if choices:
                _load_choices(acc, comm, choices)
                return

        def look() -> str:
            k = kind(input_dir, opts)
            if k == "none" and not is_url(input_dir) and not os.path.isdir(input_dir):
                return "missing"
            if k == "none" and not is_url(input_dir):
                # dckpt's files without a manifest: a save that never committed (or
                # lost its manifest), not a stock checkpoint to hand to Accelerate
                if dckpt_leftover(input_dir) or not stock_files(input_dir):
                    return "uncommitted"
                return "stock"
            return k
        found = on_rank0(comm, look, f"look up {input_dir}")
        if found == "missing":
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
        if found == "uncommitted":
            raise NotCommittedError(
                f"{input_dir} holds no committed checkpoint (no dckpt manifest) and no "
                "Accelerate checkpoint: a save that never committed or was killed "
                "before its placement; nothing there can be loaded")
        if found == "stock":
            log.info("%s is not a dckpt checkpoint: loading it with Accelerate's own "
                     "load_state", input_dir)
            return stock_load(input_dir, load_kwargs, **load_model_func_kwargs)
        if found != "dckpt":
            raise NotCommittedError(f"{input_dir}: no committed checkpoint there")
        _load_one(acc, comm, input_dir)
        return
    if not acc.project_configuration.automatic_checkpoint_naming:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    parent = acc._checkpoints_dir()  # a subclass may override it (as saves do)
    if tier is not None:
        choices, names = fast.candidates(tier, parent, NAME, opts)
        if choices:
            _load_choices(acc, comm, choices)
            stock = resolve.listed(lambda: resolve.stock_in(parent, NAME), f"list {parent}")
            # past every name held anywhere (a fast-tier commit of another world
            # size too: the next save must not overwrite its only copy)
            acc.project_configuration.iteration = max(
                acc.project_configuration.iteration,
                1 + max(number(p) for p in [*names, *stock]))
            return
    dckpt_paths, stock = resolve.listed(
        lambda: [[c.path for c in resolve.committed_in(parent, NAME, opts)],
                 resolve.stock_in(parent, NAME)], f"list {parent}")
    if dckpt_paths:
        resolve.load_newest(dckpt_paths, lambda p: _load_one(acc, comm, p))
        # the next name is past every checkpoint_<i> present: after a fallback past a
        # damaged newest one (or a rewind) the saved iteration + 1 may name it
        acc.project_configuration.iteration = max(
            acc.project_configuration.iteration,
            1 + max(number(p) for p in [*dckpt_paths, *stock]))
        return
    if stock:
        log.info("no dckpt checkpoint under %s: loading the newest stock one with "
                 "Accelerate's own load_state", parent)
        stock_load(None, load_kwargs, **load_model_func_kwargs)
        # stock never restores the iteration (the next save would be checkpoint_0)
        acc.project_configuration.iteration = 1 + max(number(s) for s in stock)
        return
    raise NotCommittedError(f"no committed checkpoint under {parent}")


def continue_run(acc: Any, comm: Comm) -> None:
    """After a load with automatic naming: the next ``checkpoint_<i>`` is past every
    name present (a rewind to an older one saves under a new name, never over a
    newer one), and the next commit orders after every checkpoint present on the
    run's timeline (after a rewind on a host whose clock is behind, rotation keeps
    the new saves and a resume takes them, not the abandoned branch). Collective
    (one broadcast); blocking I/O on rank 0 (a listing, a manifest read each)."""
    parent = acc._checkpoints_dir()  # a subclass may override it (as saves do)
    opts = acc._dckpt.storage_options

    def look() -> int:
        try:
            names = resolve.checkpoint_names(parent, NAME, opts)
        except Exception as e:  # the store is down (the fast tier loaded): go on
            log.warning("cannot list %s after the load (%s)", parent, e)
            names = []
        return max([number(p) for p in names], default=-1)
    top = on_rank0(comm, look, f"list {parent}")
    pc = acc.project_configuration
    pc.iteration = max(pc.iteration, top + 1)
    if comm.rank == 0:  # only rank 0's timeline values are recorded
        newest = resolve.newest_time(parent, NAME, opts)
        if newest is not None:
            acc._dckpt.saw(newest, "")


def _load_choices(acc: Any, comm: Comm, choices: list) -> None:
    """Load the newest of ``choices`` (:class:`.fast.Choice`, oldest first) that
    loads, falling back past damaged ones with a warning. Collective."""
    by = {c.shown(): c for c in choices}

    def hook_dir(c) -> str:  # where the save hooks' files are, as the load hooks see it
        if c.manifest_name is not None:
            extras = fast.extras_dir(acc._dckpt_tier, c.name)
            if os.path.isdir(extras) and os.listdir(extras):
                return extras
        return c.name
    resolve.load_newest(list(by), lambda k: _load_one(
        acc, comm, by[k].path, hook_dir(by[k]), by[k].manifest_name))


def _load_one(acc: Any, comm: Comm, path: str, name: str | None = None,
              manifest_name: str | None = None) -> None:
    """Load the checkpoint at ``path`` (``name``: the checkpoint's name, given to the
    load hooks; ``manifest_name``: this rank's fast-tier view). Collective."""
    name = name or path
    fsdp = acc.distributed_type == DistributedType.FSDP
    err, skip = None, []
    try:
        listed = [] if fsdp else list(acc._models)
        before = list(listed)
        for hook in acc._load_model_state_pre_hook.values():
            hook(listed, name)
        kept = {id(m) for m in listed}
        skip = [i for i, m in enumerate(acc._models) if m in before and id(m) not in kept]
    except Exception as e:
        err = e
    agree(comm, err, "the load_state pre-hooks")
    engines = {i for i, _ in dsa.engines(acc)}
    c = tree.Contents(list(acc._models), set(skip) | engines, cn.optimizers(acc))
    loaded = tree.load(path, c, cn.META_KEY, check=cn.check(acc, name),
                       storage_options=None if manifest_name else acc._dckpt.storage_options,
                       manifest_name=manifest_name,
                       strict=getattr(acc, "_dckpt_strict", True),
                       ignore=(dsa.ROOT + ".",) if engines else ())
    if engines:
        dsa.load(acc, path, getattr(acc, "_dckpt_strict", True),
                 acc._dckpt.storage_options)
    tree.apply_agreed(lambda: cn.apply(acc, loaded.objects), f"load the objects of {path}")
    acc.step = int(loaded.meta.get("step", 0))
    acc.project_configuration.iteration = int(loaded.meta.get("iteration", -1)) + 1
    loaded.restore_rng()
    acc._dckpt.saw(loaded.timeline, loaded.save_id)  # the next save continues it
    log.info("loaded %s%s (saved at %d ranks)", name,
             " from the fast tier" if manifest_name else "", loaded.world_size)


def stock_files(folder: str) -> bool:
    """Whether the local ``folder`` holds what stock ``save_state`` writes (weights,
    optimizer, RNG or sampler files). Local I/O: one listing."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(re.match(r"(model|pytorch_model|optimizer|scheduler|random_states|sampler|"
                        r"scaler|custom_checkpoint)[_.0-9a-z-]*\.(bin|safetensors|pkl|pt)$", n)
               or n.startswith(("pytorch_model_fsdp", "optimizer_")) for n in names)


def number(path: str) -> int:
    """The i of a ``checkpoint_<i>`` path (-1 when it has none). Pure."""
    tail = path.rstrip("/").rsplit("/", 1)[-1].rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else -1
