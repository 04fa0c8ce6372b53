"""The switch: a DeepSpeed engine whose ``save_checkpoint`` / ``load_checkpoint`` write
and read dckpt checkpoints, with DeepSpeed's signatures and return values.

``save_dir/<tag>`` is one dckpt commit (staged under a hidden sibling, renamed into
place once committed), ``save_dir/latest`` names it (written atomically after the
commit), and ``load_checkpoint(tag=None)`` takes the newest *committed* tag in commit
order, falling back past a damaged one with a warning. A stock DeepSpeed tag (pickles)
still loads through DeepSpeed's own method."""
from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any

from ... import _faults
from ...errors import CheckpointError
from ...protocol.collectives import Comm, agree
from ..common import place, resolve
from ..common.commit import Committer, broadcast_json
from ..common.modelfolder import write_text_atomic
from ..common.rotation import to_remove
from ..common.zero.restore import What, load_tag
from ..common.zero.tree import engine_tree
from ..common.zero.view import refusals, view

log = logging.getLogger(__name__)
ANY = re.compile(r"[^/\\]+")
LATEST = "latest"


def _write_latest(save_dir: str, tag: str, storage_options: dict | None) -> None:
    """``save_dir/latest`` = ``tag``, replaced atomically (a temporary name, fsync,
    rename; object stores: one put). Rank 0; blocking I/O."""
    path = place.join(save_dir, LATEST)
    if place.is_url(save_dir):
        fs, p = place.fresh_fs(path, storage_options)
        fs.pipe(p, tag.encode())
        return
    write_text_atomic(place.local_path(path), tag)


def _check_tag(tag: str) -> None:
    """Raise CheckpointError unless ``tag`` is a plain folder name on every platform."""
    bad = [c for c in ("/", "\\", "\x00", ":") if c in tag]
    if not tag or bad or tag.startswith(".") or tag == LATEST or len(tag.encode()) > 255 \
            or tag != tag.strip():
        raise CheckpointError(
            f"tag {tag[:80]!r} is not a usable folder name: a tag is one plain name (no "
            "'/', '\\', ':', NUL, leading '.' or spaces around it, at most 255 bytes, "
            "not 'latest')")


def _tags(load_dir: str, opts: dict | None) -> list[tuple[str, float, bool]]:
    """(path, commit time, saved with save_latest) of every committed DeepSpeed tag of
    ``load_dir``, oldest commit first; dckpt checkpoints that are not DeepSpeed tags
    (another save into the same folder) are left out. Blocking I/O: a listing and a
    manifest read per checkpoint."""
    import json

    from ..common.zero.tree import META

    out = []
    for c in resolve.committed_in(load_dir, ANY, opts):
        try:
            raw = place.read_manifest(c.path, opts).values.get(META)
            meta = json.loads(raw) if isinstance(raw, str) else None
        except Exception:  # noqa: BLE001 - damaged: kept, its load reports it
            meta = {}
        if meta is None or not isinstance(meta, dict):
            continue
        out.append((c.path, c.created, meta.get("save_latest", True) is not False))
    return out


def _stock_newer(load_dir: str, newest: float | None) -> str | None:
    """The stock tag ``latest`` names, when it is newer than ``newest`` (the newest
    dckpt tag's commit time; None: there is none): DeepSpeed's own save wrote it last.
    Local I/O: ``latest`` and a listing of the tag."""
    name = _read_latest(load_dir, None)
    if not name or place.is_url(load_dir):
        return None
    path = place.join(load_dir, name)
    if not _stock_tag(path):
        return None
    try:
        written = max(os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path))
    except (OSError, ValueError):
        return None
    return name if newest is None or written > newest else None


def _stock_tag(path: str) -> bool:
    """Whether ``path`` is a stock DeepSpeed tag folder (its pickles, no manifest)."""
    if place.is_url(path) or not os.path.isdir(path):
        return False
    return any(n.endswith("_model_states.pt") for n in os.listdir(path))


class Checkpointer:
    """dckpt's save and load for one engine (see :func:`attach`)."""

    def __init__(self, engine: Any, *, async_save: bool = False, keep_last: int | None = None,
                 storage_options: dict | None = None, compression: str | None = None,
                 local_root: str | None = None, keep_last_local: int = 2) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or isinstance(
                keep_last, bool) or keep_last < 1):
            raise CheckpointError(f"keep_last must be a positive int or None, got {keep_last!r}")
        self.engine = engine
        self.keep_last = keep_last
        self.storage_options = storage_options
        self.committer = Committer(storage_options, async_save, compression,
                                   markers=(LATEST,))
        self.tier = None
        if local_root is not None:  # the fast tier: commit on each node, copy behind
            from ..common.fast import Rotation
            from ..common.tier import LocalTier

            if isinstance(keep_last_local, bool) or not isinstance(keep_last_local, int) \
                    or keep_last_local < 1:
                raise CheckpointError(f"keep_last_local must be an int >= 1, got "
                                      f"{keep_last_local!r}")
            self.tier = LocalTier(local_root, keep_last_local, storage_options, compression)
            self.tier.adopt = ()
            self.rotation = Rotation()
            self._landed_dir: dict[str, str] = {}
            import weakref

            me = weakref.ref(self)  # the tier's copy thread outlives nothing of ours
            self.tier.landed = lambda final: (me() or _Gone).landed(final)
        self.stock_save = engine.save_checkpoint
        self.stock_load = engine.load_checkpoint

    # -- save -------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict = {},  # noqa: B006 - DeepSpeed's signature
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's ``save_checkpoint``: one dckpt commit at ``save_dir/<tag>`` (tag
        default ``global_step<N>``), then ``latest``. Collective; blocking I/O (each rank
        its ranges; asynchronous: only the snapshot copy, the commit runs in the
        background and the next save or load waits for it). Returns True. Raises
        CheckpointError on every rank alike (a tag that differs between ranks, a value
        it cannot store, a failed write: nothing is placed then)."""
        if not save_dir:
            raise ValueError("save_checkpoint: save_dir is empty")
        eng = self.engine
        tag = f"global_step{eng.global_steps}" if tag is None else str(tag)
        _check_tag(tag)
        comm = Comm()
        self.committer.finish()
        first = broadcast_json(comm, tag)
        agree(comm, None if first == tag else CheckpointError(
            f"rank {comm.rank} saves tag {tag!r}, rank 0 {first!r}: every rank must pass "
            "the same tag"), "check the tag")
        final = place.join(save_dir, tag)
        if self.tier is not None:
            return self._save_fast(save_dir, final, tag, client_state, save_latest,
                                   exclude_frozen_parameters)
        tree = self._tree(comm, final, client_state=client_state,
                          exclude_frozen=exclude_frozen_parameters, tag=tag,
                          save_latest=save_latest)
        plan = self.committer.plan(final)
        self.committer.commit(tree, plan, after=lambda: self._after(save_dir, final, tag,
                                                                    save_latest))
        return True

    def _tree(self, comm: Comm, final: str, **build_options: Any) -> dict:
        """The engine's tree (:func:`engine_tree`), or its error raised on every rank
        alike (nothing written yet). Collective."""
        err, tree = None, None
        try:
            tree = engine_tree(self.engine, **build_options)
        except CheckpointError as e:
            err = e
        agree(comm, err, f"save the DeepSpeed checkpoint {final}")
        return tree

    def _save_fast(self, save_dir: str, final: str, tag: str, client_state: dict,
                   save_latest: bool, exclude_frozen: bool) -> bool:
        """A save with ``local_root``: committed on each node's fast tier (a
        synchronous save: before returning), copied to ``save_dir/<tag>`` in the
        background (``latest`` written once the copy lands); ``keep_last`` counts the
        names committed either way. Collective."""
        from ..common import fast

        eng, comm = self.engine, Comm()
        self.rotation.flush()
        fast.check_name(self.committer, final)
        tree = self._tree(comm, final, client_state=client_state,
                          exclude_frozen=exclude_frozen, tag=tag, save_latest=save_latest)
        if save_latest:
            self._landed_dir[place.durable_name(final)] = tag
        fast.save(self.tier, self.committer, tree, final, int(eng.global_steps))
        if self.keep_last is not None:
            self.rotation.after_save(self.committer.async_save, self.tier, save_dir, ANY,
                                     place.durable_name(final), self.keep_last,
                                     self.storage_options)
        return True

    def landed(self, final: str) -> None:
        """The fast tier's copy thread (every rank), ``final`` placed durably: rank 0
        points ``latest`` at it (never at a tag not yet copied)."""
        tag = self._landed_dir.pop(final, None)
        if tag is not None and Comm().rank == 0:
            try:
                _write_latest(final.rsplit("/", 1)[0], tag, self.storage_options)
            except OSError as e:  # the tag is there; DeepSpeed's tools read latest only
                log.warning("could not write %s/latest: %s", final.rsplit("/", 1)[0], e)

    def _after(self, save_dir: str, final: str, tag: str, save_latest: bool) -> None:
        """Rank 0, once the tag is committed and placed: ``latest``, then rotation."""
        if save_latest:
            _faults.fault("latest", 0)  # crash tests: placed, ``latest`` not yet written
            _write_latest(save_dir, tag, self.storage_options)
        if self.keep_last is not None:
            # DeepSpeed tags only (never another checkpoint saved into the folder), and
            # never the one ``latest`` names (what stock tools and tag=None resume)
            from ..common.rotation import Committed

            latest = _read_latest(save_dir, self.storage_options)
            held = place.join(save_dir, latest) if latest else None
            got = [Committed(p, t) for p, t, _ in _tags(save_dir, self.storage_options)]
            keep = held is not None and held != final and any(c.path == held for c in got)
            pool = [c for c in got if not (keep and c.path == held)]
            for old in to_remove(pool, max(1, self.keep_last - int(keep)), final):
                _faults.fault("rotate", 0)
                log.info("keep_last=%d: removing %s", self.keep_last, old)
                place.remove_whole(old, self.storage_options)

    # -- load -------------------------------------------------------------------
    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple:
        """DeepSpeed's ``load_checkpoint``: returns ``(load_path, client_state)``, or
        ``(None, None)`` when ``load_dir`` holds no checkpoint (as stock). ``tag=None``:
        the newest committed dckpt tag (never a partial one, whatever ``latest`` says),
        falling back past a damaged one with a warning; a stock DeepSpeed tag goes to
        DeepSpeed's own method. Collective; blocking I/O (each rank its ranges). Raises
        CheckpointError on every rank alike (a damaged named tag, another model)."""
        if custom_load_fn is not None:
            raise CheckpointError("custom_load_fn is not supported by dckpt's DeepSpeed "
                                  "checkpoints")
        self.committer.finish()
        what = What(load_optimizer_states, load_lr_scheduler_states, load_module_only,
                    load_module_strict)
        stock_kw = dict(load_module_strict=load_module_strict,
                        load_optimizer_states=load_optimizer_states,
                        load_lr_scheduler_states=load_lr_scheduler_states,
                        load_module_only=load_module_only)
        opts = self.storage_options
        if self.tier is not None:
            return self._load_fast(load_dir, tag, what)
        if tag is not None:
            path = place.join(load_dir, str(tag))
            k = resolve.listed(lambda: place.kind(path, opts), f"look at {path}")
            if k != "dckpt":
                if resolve.listed(lambda: _stock_tag(path), f"look at {path}"):
                    return self.stock_load(load_dir, tag, **stock_kw)
                log.warning("no checkpoint at %s", path)
                return None, None
            return path, self._load(path, what, load_dir)
        def look() -> list:
            tags = _tags(load_dir, opts)
            # tag=None resumes what a run saved as its latest: evaluation snapshots
            # saved with save_latest=False are passed over (as stock's ``latest``)
            names = [p for p, _, latest in tags if latest]
            newest = max((t for p, t, latest in tags if latest), default=None)
            return [names, _stock_newer(load_dir, newest), len(tags)]
        names, stock, found = resolve.listed(look, f"list {load_dir}")
        if stock is not None:  # DeepSpeed's own save wrote the newest tag (latest names it)
            return self.stock_load(load_dir, None, **stock_kw)
        if not names:
            log.warning("no committed checkpoint in %s%s", load_dir,
                        f" saved with save_latest=True ({found} without)" if found else "")
            return None, None
        return resolve.load_newest(names, lambda p: self._load(p, what, load_dir),
                                   "DeepSpeed checkpoint")

    def _load_fast(self, load_dir: str, tag: Any, what: What) -> tuple:
        """A load with ``local_root``: the newest committed tag, from this node's fast
        tier when it holds it (else its durable copy), falling back past a damaged one
        (``tag``: that one only). Collective."""
        from ..common import fast

        self.rotation.flush()
        if tag is not None:
            choices = fast.one(self.tier, place.join(load_dir, str(tag)), self.storage_options)
        else:
            choices, _ = fast.candidates(self.tier, load_dir, ANY, self.storage_options)
        if not choices:
            log.warning("no committed checkpoint in %s", load_dir)
            return None, None
        by = {c.shown(): c for c in choices}
        shown, client = resolve.load_newest(
            list(by), lambda k: self._load(by[k].path, what, load_dir, by[k].manifest_name),
            "DeepSpeed checkpoint")
        return by[shown].name, client

    def _load(self, path: str, what: What, load_dir: str,
              manifest_name: str | None = None) -> dict:
        client = load_tag(view(self.engine), path, what,
                          None if manifest_name else self.storage_options,
                          manifest_name=manifest_name)
        if manifest_name is not None:
            return client
        stamp = resolve.listed(lambda: place.stamp(path, self.storage_options),
                               f"read {path}'s manifest")
        newest = resolve.listed(lambda: resolve.newest_time(load_dir, ANY, self.storage_options),
                                f"list {load_dir}")
        if stamp:
            self.committer.saw(max(float(stamp[1]), newest or 0.0), str(stamp[0]))
        return client

    def wait(self) -> None:
        """Wait for the asynchronous save in flight and raise its error on every rank
        (with ``local_root``: its local commit, then every durable copy queued: a failed
        copy is logged, that tag stays local). Collective when one is in flight."""
        self.committer.finish()
        if self.tier is not None:
            self.rotation.flush()
            self.tier.drain()


class _Gone:
    @staticmethod
    def landed(final: str) -> None:
        return None


def _read_latest(load_dir: str, opts: dict | None) -> str | None:
    path = place.join(load_dir, LATEST)
    try:
        if place.is_url(load_dir):
            fs, p = place.fresh_fs(path, opts)
            return fs.cat(p).decode().strip()[:4096]
        with open(place.local_path(path), encoding="utf-8") as f:
            return f.read(4096).strip()
    except (OSError, UnicodeDecodeError):
        return None


def attach(engine: Any, *, async_save: bool = False, keep_last: int | None = None,
           storage_options: dict | None = None, compression: str | None = None,
           local_root: str | None = None, keep_last_local: int = 2) -> Any:
    """Make ``engine`` (built by ``deepspeed.initialize``, the Trainer or Accelerate)
    save and load dckpt checkpoints: its ``save_checkpoint`` and ``load_checkpoint``
    are replaced by dckpt's, same signatures and return values (the originals stay as
    ``engine.dckpt.stock_save`` / ``stock_load``); ``engine.destroy()`` waits for an
    asynchronous save first. Returns ``engine``. Not collective; no I/O. Raises
    CheckpointError for what is not supported (pipeline parallelism, MoE, NVMe offload,
    model parallelism, an unknown optimizer wrapper, round-robin gradients)."""
    if isinstance(getattr(engine, "dckpt", None), Checkpointer):
        raise CheckpointError("this engine is already attached to dckpt")
    refusals(engine)
    view(engine)  # refuses a layout it does not know, now rather than at the first save
    ck = Checkpointer(engine, async_save=async_save, keep_last=keep_last,
                      storage_options=storage_options, compression=compression,
                      local_root=local_root, keep_last_local=keep_last_local)

    @functools.wraps(ck.save_checkpoint)
    def save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006
                        exclude_frozen_parameters=False):
        return ck.save_checkpoint(save_dir, tag, client_state, save_latest,
                                  exclude_frozen_parameters)

    @functools.wraps(ck.load_checkpoint)
    def load_checkpoint(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False,
                        custom_load_fn=None):
        return ck.load_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states,
                                  load_lr_scheduler_states, load_module_only, custom_load_fn)

    stock_destroy = getattr(engine, "destroy", None)

    def destroy(*a: Any, **kw: Any) -> Any:
        ck.wait()
        return stock_destroy(*a, **kw) if stock_destroy is not None else None

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
    engine.destroy = destroy
    engine.dckpt = ck
    return engine
