"""The loads of :class:`dckpt.integrations.torchtitan.DckptCheckpointManager` that are
not a resume of its own steps: the initial loads (a folder with no checkpoint yet) from
another dckpt checkpoint, from a DCP checkpoint, or from a Hugging Face safetensors
directory through the model's state dict adapter; and the steps torchtitan's own DCP
manager left in the folder (found by :func:`dcp_steps`, resumed by :func:`load_dcp`).
Imports torch's DCP only for a DCP source; never imports torchtitan."""
from __future__ import annotations

import os
import re
import stat
from typing import Any

from ...errors import CheckpointError, StateMismatchError

MODEL = "model"
DCP_METADATA = ".metadata"  # what makes a folder a DCP checkpoint
HF_INDEX = "model.safetensors.index.json"  # torchtitan's sharded last_save_in_hf step
MANAGER_PREFIX = "state."  # CheckpointManager saves the state under this key
# torchtitan's DCP manager names its steps step-N (dckpt's are zero-padded, step-0000000N,
# and never hold DCP_METADATA or HF_INDEX, so they are not taken for its steps)
DCP_STEP = re.compile(r"^step-(\d+)$")


def _is_dcp(path: str) -> bool:
    from ...storage.fsspec_storage import make_storage

    storage, root = make_storage(path, None)
    return storage.exists(storage.join(root, DCP_METADATA))


def dcp_steps(folder: str) -> list[tuple[int, str, float | None]]:
    """The steps torchtitan's DCP CheckpointManager left in ``folder``, ascending, each
    with its kind and its commit time: ``"dcp"`` (a ``step-N`` with DCP's
    ``.metadata``, which DCP writes last, so a crashed save is not listed:
    torchtitan's own rule; the time is that file's modification time, DCP's commit
    point) or ``"hf"`` (a ``step-N`` with only an HF safetensors index: a
    ``last_save_in_hf`` export, not resumable; the index's time). The time is None
    where the storage reports none. Not collective: one rank lists the folder and
    stats at most two files per step directory; [] for a missing folder. Raises
    OSError when the folder cannot be listed."""
    from ...storage.fsspec_storage import make_storage

    storage, root = make_storage(folder, None)
    try:
        entries = storage.listdir(root)
    except FileNotFoundError:
        return []
    found = []
    for e in entries:
        m = DCP_STEP.match(e.name)
        if not (m and e.is_dir):
            continue
        for name, kind in ((DCP_METADATA, "dcp"), (HF_INDEX, "hf")):
            try:
                t = _mtime(storage, storage.join(root, e.name, name))
            except FileNotFoundError:
                continue  # not this kind (or removed meanwhile: torchtitan's keep_latest_k)
            found.append((int(m.group(1)), kind, t))
            break
    return sorted(found)


def _mtime(storage: Any, path: str) -> float | None:
    """The modification time of the file at ``path`` (None: the store reports none).
    One stat (not a listing of the step: a DCP step holds a file per rank). Raises
    FileNotFoundError when there is no such file."""
    fs = getattr(storage, "fs", None)  # an FsspecStorage's file system; None: local
    if fs is None:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(path)
        return st.st_mtime
    from ...storage.fsspec_storage import entry_mtime

    fs.invalidate_cache(path)
    info = fs.info(path)
    if info.get("type") == "directory":
        raise FileNotFoundError(path)
    return entry_mtime(info)


class _Mismatch(Exception):
    """Raised inside DCP's planning by :func:`_planner`'s planner: the state asks for what the
    checkpoint does not hold as asked (a missing key, another size). Module-level and
    built from its message alone: DCP pickles it to gather it from every rank."""


def _planner() -> Any:
    """DCP's default load planner, its local planning errors marked as :class:`_Mismatch`:
    they compare the state with the checkpoint's metadata (read fine by then), so they
    are a state that does not match, never damage; every other failure DCP gathers
    (a missing, truncated or unreadable file) is."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def create_local_plan(self):  # noqa: ANN202 - DCP's LoadPlan
            try:
                return super().create_local_plan()
            except Exception as e:
                raise _Mismatch(f"{type(e).__name__}: {e}") from None

    return Planner()


def load_dcp(target: dict[str, Any], path: str) -> None:
    """Load ``target`` (``{"model": ModelWrapper, ...}``: Statefuls and values) from the
    DCP checkpoint at ``path`` with DCP itself, its keys laid out as torchtitan's DCP
    manager saves them (the model's flattened to the top, the other states nested
    under their names); DCP converts floating dtypes, and reshards. Collective. DCP
    unpickles its metadata: call it only for a checkpoint the user named, or that the
    job's own folder holds. Raises, naming ``path`` and DCP's error, on every rank
    alike (DCP gathers its errors): StateMismatchError when ``target`` asks for what
    the checkpoint lacks (a key, a size), CheckpointError when DCP cannot read it (a
    missing, truncated or unreadable file: damage, which
    :func:`dckpt.tiers.chooser.fallback_worthy` lets a resume skip)."""
    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.checkpoint.api import CheckpointException

    flat = {k: v for k, v in target.items() if k != MODEL}
    if MODEL in target:
        flat.update(target[MODEL].state_dict())
    try:
        torch_dcp.load(flat, checkpoint_id=path, planner=_planner())
    except CheckpointException as e:  # a BaseException: make it dckpt's Exception
        cls = StateMismatchError if any(isinstance(c, _Mismatch) for c in _causes(e)) \
            else CheckpointError
        raise cls(f"could not load the DCP checkpoint {path}: {_failures(e)}") from e
    if MODEL in target:
        target[MODEL].load_state_dict(flat)


def resume_dcp(target: dict[str, Any], folder: str, step: int, kind: str) -> str:
    """Resume ``target`` from ``step-{step}`` that torchtitan's DCP manager saved in
    ``folder`` (``kind`` from :func:`dcp_steps`), with :func:`load_dcp`; returns its
    path. Collective. Raises, saying what to do instead, StateMismatchError for an
    HF-only step (no training state) and for a step that lacks what the state asks
    for (a model-only last step lacks the optimizer: start a new job from it, or
    resume an earlier step); CheckpointError for a step DCP cannot read (damaged)."""
    path = f"{folder.rstrip('/')}/step-{step}"
    if kind != "dcp":
        raise StateMismatchError(
            f"{path} holds only Hugging Face safetensors (torchtitan's last_save_in_hf "
            "export of a finished run), not a training state to resume: start a new job "
            f"from it (another checkpoint.folder, initial_load_path={path}, "
            "initial_load_in_hf=True, initial_load_model_only=True), resume an earlier "
            "step with checkpoint.load_step, or move it out of the folder")
    try:
        load_dcp(target, path)
    except StateMismatchError as e:
        raise StateMismatchError(
            f"{str(e).rstrip('.')}. It is step {step} of torchtitan's DCP manager in "
            f"checkpoint.folder {folder}: if it is a model-only last step "
            "(last_save_model_only), start a new job from it (another folder, "
            f"initial_load_path={path}, initial_load_model_only=True); else resume an "
            "earlier step with checkpoint.load_step, or leave a component out with "
            "checkpoint.exclude_from_loading") from e
    except CheckpointError as e:
        raise CheckpointError(
            f"{str(e).rstrip('.')}. It is step {step} of torchtitan's DCP manager in "
            f"checkpoint.folder {folder}: its files are missing or damaged") from e
    return path


def _causes(e: BaseException) -> list[BaseException]:
    """The exceptions in DCP's CheckpointException, one per failing rank."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [p[0] if isinstance(p, tuple) and p else p for p in failures.values()]


def _failures(e: BaseException) -> str:
    """DCP's CheckpointException in one line per distinct cause (its str() holds every
    rank's traceback; the tracebacks stay on the chained exception)."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return str(e)
    causes: dict[str, list[int]] = {}
    for rank, pair in sorted(failures.items()):
        exc = pair[0] if isinstance(pair, tuple) and pair else pair
        what = str(exc) if isinstance(exc, _Mismatch) else f"{type(exc).__name__}: {exc}"
        causes.setdefault(what, []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {c}"
                     for c, r in causes.items())


def load_initial(target: dict[str, Any], path: str, *, cast: bool = False) -> None:
    """Load ``target`` (``{"model": ModelWrapper, ...}``: Statefuls and values) from
    the checkpoint at ``path``. Collective. A dckpt checkpoint: a step of a
    CheckpointManager (keys under "state.") or a plain ``dckpt.save`` directory;
    keys the checkpoint holds that ``target`` does not ask for are ignored (a
    model-only load of a full checkpoint), keys it lacks are an error; ``cast``:
    floating-point tensors saved in another floating dtype are converted (a bf16
    ``last_save_model_only`` export into an fp32 model), else a dtype differing is an
    error. A DCP checkpoint (``.metadata``): :func:`load_dcp` (DCP converts dtypes
    whatever ``cast``). Raises CheckpointError."""
    if _is_dcp(path):
        load_dcp(target, path)
        return
    from ...protocol.restore import load
    from ...view.open import open as open_checkpoint

    with open_checkpoint(path) as ckpt:
        keys = ckpt.keys()
    managed = any(k.startswith(MANAGER_PREFIX) for k in keys)
    state = {"state": target} if managed else target
    load(state, path, strict=False, cast=cast)


def load_hf_model(model: Any, adapter: Any, path: str, quantized: bool) -> None:
    """Load the model (torchtitan's ModelWrapper) from the HF safetensors at
    ``path``, as torchtitan's DCP manager does: the adapter's ``to_hf`` names the
    tensors, they are filled in place, ``from_hf`` maps them back. dckpt's
    :func:`~dckpt.interop.hf_load.load_hf` reads each rank's byte ranges; quantized
    checkpoints go to the adapter's own DCP reader. Collective."""
    hf_sd = adapter.to_hf(model.state_dict())
    if quantized:
        import torch.distributed.checkpoint as torch_dcp

        torch_dcp.load(hf_sd, storage_reader=adapter.get_hf_storage_reader(path, True))
    else:
        from ...interop.hf_load import load_hf

        load_hf(hf_sd, path)
    model.load_state_dict(adapter.from_hf(hf_sd))
