"""Which checkpoint ``DckptTrainer.train`` resumes, and the checks before the Trainer
reads one: a Trainer's dckpt checkpoint whose ``trainer_state.json`` agrees with its
commit; leftovers without a manifest passed over with a warning; the folder of a JIT
save killed after transformers' sentinel replaced by the newest committed one."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ...errors import IntegrityError, NotCommittedError, StateMismatchError
from ...protocol.collectives import Comm
from ..common import resolve
from ...format.manifest import MANIFEST_NAME
from ..common.place import dckpt_leftover, is_dckpt_file, kind, read_manifest
from ..common.verify import verify_shared

log = logging.getLogger(__name__)
NAME = re.compile(PREFIX_CHECKPOINT_DIR + r"-[0-9]+")
META_KEY = "__transformers__"
STATE_FILE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
# transformers' JIT checkpoint (trainer_jit_checkpoint.py) creates checkpoint-N/ holding
# this file before it calls _save_checkpoint, and removes it after: a folder holding it
# is an incomplete save (nothing in transformers reads it)
JIT_SENTINEL = "checkpoint-is-incomplete.txt"
RESUME_PREFIX = ".trainer-resume-"  # per-rank folders handed to the Trainer (materialize)


def warn_leftovers(out: str) -> None:
    """Rank 0: warn about each ``checkpoint-N`` of ``out`` holding dckpt's files
    without a manifest (a lost manifest, a copy made before the commit): it is
    passed over, and the next save of that step replaces it. Local I/O."""
    if Comm().rank != 0:
        return
    try:
        names = sorted(n for n in os.listdir(out) if NAME.fullmatch(n))
    except OSError:
        return
    for n in names:
        if dckpt_leftover(os.path.join(out, n)):
            log.warning("%s holds dckpt data files but no manifest (a lost manifest, or "
                        "a copy made before the commit): not resumable, passed over; "
                        "the next save of that step replaces it", os.path.join(out, n))

def _incomplete(p: str) -> bool:
    """Whether ``p`` is the folder of a save transformers' JIT checkpoint began: it
    holds its sentinel, or nothing at all (the sentinel is removed when the save call
    returns, before a fast-tier save's copy fills the folder). Local I/O."""
    try:
        names = os.listdir(p)
    except OSError:
        return False
    return JIT_SENTINEL in names or (not names and NAME.fullmatch(os.path.basename(p))
                                     is not None)


def instead_of_incomplete(p: str) -> str:
    """``p`` holds transformers' JIT sentinel, or nothing: a save killed before it
    completed (``get_last_checkpoint`` returns it, as the highest number with a
    folder). The
    newest committed checkpoint beside it, verified, with a warning; else
    NotCommittedError naming ``p``. Collective (as :meth:`train`'s lookup)."""
    parent = os.path.dirname(p)
    paths = resolve.listed(lambda: [c.path for c in resolve.committed_in(parent, NAME)],
                           f"list {parent}")
    if not paths:
        raise NotCommittedError(f"{p} is an incomplete save (it holds transformers' "
                                f"{JIT_SENTINEL}, or nothing) and no committed checkpoint "
                                "is beside it")
    path, _ = resolve.load_newest(paths, lambda q: (precheck(q),
                                                    verify_shared(q)))
    if Comm().rank == 0:
        log.warning("%s is an incomplete save (it holds %s, or nothing): resuming from "
                    "%s, the newest committed checkpoint beside it", p, JIT_SENTINEL, path)
    return path


def precheck(path: str) -> None:
    """Before the Trainer reads anything of ``path``: it is a Trainer's checkpoint
    (StateMismatchError naming its framework otherwise) holding its
    ``trainer_state.json`` as a JSON object (IntegrityError otherwise: it is not in
    the manifest's checksums, so it is checked here). Collective (a broadcast of
    rank 0's finding); blocking I/O on rank 0: one manifest read and a stat."""
    def look() -> list:
        values = read_manifest(path).values
        other, step = None, None
        if not isinstance(values.get(META_KEY), str):
            fw = [k.strip("_") for k in values if k.startswith("__") and k.endswith("__")]
            other = fw[0] if fw else "dckpt.save"
        else:
            try:
                step = json.loads(values[META_KEY]).get("global_step")
            except (ValueError, AttributeError):
                step = None
        try:
            with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
                doc = json.load(f)
            state = "" if isinstance(doc, dict) else "is not a JSON object"
            # the file is outside the manifest's checksums: its step must be the
            # commit's (the Trainer takes the step and the data skip from it)
            if not state and step is not None and doc.get("global_step") != step:
                state = (f"says global_step {str(doc.get('global_step'))[:20]} but the "
                         f"commit holds step {step}")
        except FileNotFoundError:
            state = "is missing (removed by hand?)"
        except (OSError, ValueError) as e:
            state = f"cannot be read ({e})"
        return [other, state]
    other, state = resolve.listed(look, f"read the manifest of {path}")
    if other is not None:
        raise StateMismatchError(f"{path} is a dckpt checkpoint of {other!r}, not of the "
                                 "transformers Trainer: load it with what saved it")
    if state:
        raise IntegrityError(f"{path} is committed but its {STATE_FILE} {state}: the "
                             "Trainer cannot resume it")


def precheck_local(slot: str, view: str, accept=None) -> None:
    """:func:`precheck` for a fast-tier commit: this rank's ``view`` of ``slot`` is a
    Trainer's checkpoint whose metadata holds its trainer_state.json, at the commit's
    step, and the node's files of it verify (read by each node's local rank 0).
    Collective (the outcome agreed); local I/O. Raises on every rank alike:
    StateMismatchError (another framework's, or refused by ``accept(manifest)``, which
    raises for a commit this run cannot read from its node), IntegrityError."""
    from ...format import manifest as mf
    from ...protocol.collectives import agree
    from ...protocol.restore import read_manifest_bytes
    from ...storage.fsspec_storage import make_storage

    err = None
    try:
        storage, root = make_storage(slot)
        m = mf.parse(read_manifest_bytes(storage, root, view), f"{slot}/{view}")
        state_json(m, slot)
        if accept is not None:  # e.g. a DeepSpeed tag of another layout: its durable copy
            accept(m)
        # the node's files read once before the Trainer reads anything (as the durable
        # copy is verified): damage falls back to the name's durable copy now, not in
        # the middle of train() where nothing can fall back
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            from ...catalog.verify import verify_local_step

            report = verify_local_step(storage, root, slot)
            if report.problems:
                raise IntegrityError(f"the fast tier's commit {slot} is damaged: "
                                     + "; ".join(report.problems[:3]))
    except Exception as e:
        err = e
    agree(Comm(), err, f"check the fast tier's commit {slot}")


def state_json(m, where: str) -> str:
    """The trainer_state.json text a Trainer checkpoint's manifest ``m`` records, after
    checking it is a JSON object at the commit's step. Pure. Raises
    StateMismatchError (not a Trainer's checkpoint), IntegrityError."""
    raw = m.values.get(META_KEY)
    if not isinstance(raw, str):
        raise StateMismatchError(f"{where} is not a transformers Trainer checkpoint")
    try:
        meta = json.loads(raw)
        text = meta.get("trainer_state")
        doc = json.loads(text) if isinstance(text, str) else None
    except (ValueError, AttributeError) as e:
        raise IntegrityError(f"{where}: its Trainer metadata cannot be read ({e})") from None
    if not isinstance(doc, dict) or doc.get("global_step") != meta.get("global_step"):
        raise IntegrityError(f"{where} records no {STATE_FILE} at its step "
                             f"{str(meta.get('global_step'))[:20]}: the Trainer cannot resume it")
    return text


def sweep_resume_folders(root: str) -> None:
    """Remove the per-rank resume folders (:func:`materialize`) of processes of this
    host that are gone (a run killed while resumed from the fast tier). Local I/O;
    never raises."""
    import socket

    from ..common.place import _alive

    host = socket.gethostname()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for n in names:
        if not n.startswith(RESUME_PREFIX):
            continue
        parts = n[len(RESUME_PREFIX):].rsplit("-", 2)
        if len(parts) == 3 and parts[0] == host and parts[1].isdigit() \
                and not _alive(int(parts[1])):
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)


def materialize(root: str, slot: str, view: str, name: str, extras: str | None = None) -> str:
    """Write the trainer_state.json of the fast-tier commit ``slot`` (this rank's
    ``view``) into a folder of its own under ``root`` named as the checkpoint ``name``
    (the Trainer reads the file from the folder it is told to resume), link there each
    entry of ``extras`` (what the save's chain wrote beside the slot: a subclass's
    state file, the model folder; on the node of the rank that wrote it), or when
    that is gone of the durable copy ``name`` (but dckpt's own files), and return
    that folder. Each rank writes its own. Local I/O: a file and a link per entry;
    raises OSError, what :func:`state_json` raises."""
    import socket
    import uuid

    from ...format import manifest as mf
    from ...protocol.restore import read_manifest_bytes
    from ...storage.fsspec_storage import make_storage

    storage, sroot = make_storage(slot)
    m = mf.parse(read_manifest_bytes(storage, sroot, view), f"{slot}/{view}")
    folder = os.path.join(root, f"{RESUME_PREFIX}{socket.gethostname()}-{os.getpid()}-"
                                f"{uuid.uuid4().hex[:8]}", os.path.basename(name))
    os.makedirs(folder)
    with open(os.path.join(folder, STATE_FILE), "w", encoding="utf-8") as f:
        f.write(state_json(m, slot))
    src, entries = extras, []
    for src in (extras, name):  # beside the slot; once its copy landed, the copy
        try:
            entries = [n for n in os.listdir(src) if n != MANIFEST_NAME
                       and not is_dckpt_file(n)] if src is not None else []
        except OSError:  # none on this node
            entries = []
        if entries:
            break
    for n in entries:
        if n != STATE_FILE:  # the checksummed copy above is the one read
            os.symlink(os.path.join(src, n), os.path.join(folder, n))
    return folder


def named(p: str) -> str | None:
    """The dckpt checkpoint an explicit ``resume_from_checkpoint`` path resumes
    (checked), None for a stock one (migration). Collective."""
    found = resolve.listed(lambda: "jit" if _incomplete(
        p) else "leftover" if dckpt_leftover(p) else kind(p),
        f"look up {p}")
    if found == "leftover":
        raise NotCommittedError(
            f"{p} holds dckpt data files but no manifest: a save that never "
            "committed, or whose manifest was lost; it cannot be resumed (resume "
            "with resume_from_checkpoint=True for the newest committed one)")
    if found == "dckpt":
        precheck(p)
        return p
    if found == "jit":
        return instead_of_incomplete(p)
    log.info("%s is not a dckpt checkpoint: the stock Trainer resumes it", p)
    return None

def pick(tier, choices: list,
         accept=None) -> tuple[str | None, tuple[str, str | None] | None]:
    """With the fast ``tier`` (a :class:`..common.tier.LocalTier`): the newest of ``choices`` (:class:`..common.fast.Choice`)
    that passes its checks, as (the folder the Trainer is told to resume, what the
    load reads); (None, None) when there is none. A fast-tier commit's folder is a
    per-rank one holding its trainer_state.json (removed when train() ends);
    ``accept(manifest)`` may refuse a fast-tier commit (see :func:`precheck_local`).
    Collective; local I/O."""
    if not choices:
        return None, None
    by = {c.shown(): c for c in choices}

    def check(k: str) -> None:
        c = by[k]
        if c.manifest_name is None:
            precheck(c.path)
            verify_shared(c.path)
        else:
            precheck_local(c.path, c.manifest_name, accept)
    key, _ = resolve.load_newest(list(by), check)
    c = by[key]
    if c.manifest_name is None:
        return c.path, (c.path, None)
    from ..common.fast import extras_dir

    folder = materialize(tier.root, c.path, c.manifest_name, c.name,
                         extras_dir(tier, c.name))
    if Comm().rank == 0:
        log.info("resuming %s from the fast tier %s", c.name, c.path)
    return os.path.abspath(folder), (c.path, c.manifest_name)
