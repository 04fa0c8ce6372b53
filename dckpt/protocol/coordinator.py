"""Rank 0's side of the save protocol (see :mod:`dckpt.protocol.commit`): validating
the ranks' plans (or reusing a cached plan), taking the save's lease, committing the
manifest once every rank's file is there, and removing what a failed or replaced save
leaves. Also the small wire helpers both sides use. I/O on rank 0 only; no collective.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import struct
import time
import uuid
from typing import Any, Sequence

from .. import _faults
from ..errors import AlreadyExistsError, CheckpointError
from ..format import manifest as mf
from ..format.version import __version__
from ..format import codec
from ..layout import delta, derive, localplan, plan as gplan, rules
from ..storage.fsspec_storage import make_storage
from .collectives import error_payload
from . import plancache, votes as votes_mod
from .intent import Intent
from ..format.filenames import save_files_prefixes
from .commitfiles import _check_files, _current_files, _remove_files, referenced_by_siblings

log = logging.getLogger(__name__)
_U64 = struct.Struct("<Q")


def _pack(doc: dict, tail: bytes = b"") -> bytes:
    head = json.dumps(doc).encode()
    return _U64.pack(len(head)) + head + tail


def _unpack(data: bytes) -> tuple[dict, bytes]:
    (n,) = _U64.unpack_from(data, 0)
    return json.loads(data[8:8 + n]), data[8 + n:]


def check_base(storage, root: str, base: str, storage_options: dict | None) -> tuple[Any, str]:
    """(storage, root) of ``base``, which must be another checkpoint directory in the
    same parent as ``root`` on the same storage: a manifest may only reference its
    siblings. No I/O. Raises CheckpointError naming both."""
    bstorage, broot = make_storage(base, storage_options)
    parent, _, name = root.rstrip("/").rpartition("/")
    bparent, _, bname = broot.rstrip("/").rpartition("/")
    if type(bstorage) is not type(storage) or bparent != parent or not bname or bname == name:
        raise CheckpointError(
            f"base {base!r} must be another checkpoint in the same parent directory as "
            f"{root!r} (an incremental checkpoint only references its siblings, as "
            "CheckpointManager lays them out)")
    return bstorage, broot


def validate_plans(blobs: list[bytes], where: str,
                   decoded: list | None = None) -> tuple[gplan.GlobalPlan | None, dict]:
    """Rank 0: decode and validate every rank's plan. Returns (plan, {}) or (None,
    {rank: error payload}) for the ranks whose planning failed. Raises
    StateMismatchError (ranks disagree). Pure CPU, no I/O."""
    cache: dict = {}  # byte-identical key tables are decoded once
    plans = [localplan.decode(b, cache) for b in blobs]
    if decoded is not None:
        decoded[:] = plans
    errors = {r: p.error for r, p in enumerate(plans) if p.error}
    if errors:
        return None, errors
    gp = gplan.plan_global(plans)
    if gp.conflicts:
        k, r = next(iter(gp.conflicts.items()))
        log.warning(
            "save to %s: %d value(s) differ between ranks, e.g. %r on rank %d; the "
            "lowest rank's value is saved. Give rank-local values a key per rank.",
            where, len(gp.conflicts), k, r)
    return gp, {}


class _Coordinator:
    """Rank 0's side of one save: validates plans, then commits or rolls back."""

    def __init__(self, storage, root: str, overwrite: bool, world: int,
                 cache: plancache.CoordCache | None = None) -> None:
        self.storage, self.root, self.overwrite, self.world = storage, root, overwrite, world
        self.cache = cache
        self.awaiting: str | None = None  # the second message plan() expects
        self._derived = False  # the values awaited complete a derived plan
        self.save_id = ""
        self.gp: gplan.GlobalPlan | None = None
        self.intent: Intent | None = None
        self.committed = False
        self.base: mf.Manifest | None = None
        self.base_dir = ""
        self.side_prefix = ""  # rank 0's SideFile prefix: the votes must agree

    def plan(self, blobs: list[bytes], base: str | None = None,
             storage_options: dict | None = None) -> bytes:
        """Decode and validate every rank's plan, or reuse the cached plan when every
        rank offered an unchanged one (else reply "resend"); read the base's manifest;
        take the save's lease (intent file); reply with the save id, the base's
        manifest bytes and the write masks (none when cached: ranks keep theirs)."""
        try:
            cached, awaiting, self.awaiting = False, self.awaiting, None
            derived, self._derived = self._derived, False
            if self.cache is None:
                self.gp, errors = validate_plans(blobs, self.root)
            elif awaiting == "values":
                self.gp = self.cache.with_values(blobs)
                if self.gp is None:
                    self.awaiting = "full"
                    return _pack({"resend": "full"})
                cached, errors = not derived, {}
            elif (got := self.cache.reuse_uniform(blobs)) is not None:
                self.gp, cached, errors = got, True, {}  # a later save, nothing changed
            else:
                offers = [plancache.decode_offer(b) for b in blobs]
                if any(o.rule for o in offers):
                    gp = self._derive(offers)
                    kind, got = self.cache.adopt(offers, gp) if gp is not None else ("full", None)
                    if kind != "plan":
                        self.awaiting, self._derived = kind, kind == "values"
                        return _pack({"resend": kind, "ranks": got or []})
                    self.gp, errors, derived = got, {}, True
                elif any(o.cached for o in offers):
                    kind, got = self.cache.reuse(offers)
                    if kind != "plan":
                        self.awaiting = kind
                        return _pack({"resend": kind, "ranks": got or []})
                    self.gp, cached, errors = got, True, {}
                else:
                    self._plans: list = []
                    self.gp, errors = validate_plans([o.blob for o in offers], self.root,
                                                     self._plans)
            if errors:
                return _pack({"errors": errors})
            st = self.storage
            if not self.overwrite and st.exists(st.join(self.root, mf.MANIFEST_NAME)):
                raise self._exists()  # early and cheap; the commit itself is exclusive
            base_bytes = b""
            if base is not None:
                from .restore import read_manifest_bytes

                bstorage, broot = check_base(st, self.root, base, storage_options)
                base_bytes = read_manifest_bytes(bstorage, broot)
                self.base = mf.parse(base_bytes, bstorage.join(broot, mf.MANIFEST_NAME))
                self.base_dir = broot.rstrip("/").rpartition("/")[2]
            self.begin(uuid.uuid4().hex[:16])
            # the base read (its normalised root): every rank checks that it passed the
            # same one (dckpt.protocol.commit._check_base)
            used = broot.rstrip("/") if base is not None else None
            if cached:
                return _pack({"save_id": self.save_id, "base_len": len(base_bytes),
                              "base": used, "cached": True}, base_bytes)
            doc = {"save_id": self.save_id, "base_len": len(base_bytes), "base": used}
            if self.cache is not None:  # every rank accepts this plan with this reply
                doc["plan_id"] = (self.cache.plan_id if derived else  # adopted
                                  self.cache.store(offers, self._plans, self.gp)).hex()
            return _pack(doc, base_bytes + gplan.encode_writes(self.gp))
        except Exception as e:
            return _pack({"errors": {0: error_payload(e)}})

    def _derive(self, offers: list) -> gplan.GlobalPlan | None:
        """The plan derived from the ranks' rule offers (values not yet added), or None
        when the gathered path must plan: a rank offered its full plan, the signatures
        differ, the layout is not derivable, or a rank's plan hash differs from the
        hash of the boxes derived for it. The last is a fallback, not an error: the
        gathered plan is checked from the boxes the ranks really hold, so a wrong
        derivation can cost a second gather but never commit. O(ranks + tensors)
        numpy passes (dckpt.layout.derive)."""
        if not all(o.rule for o in offers):
            return None  # a rank could not describe its plan by rule (or failed)
        own = offers[0]
        if any(o.sig_hash != own.sig_hash for o in offers) or own.values is None or \
                codec._xxh().xxh3_128_digest(own.signature) != own.sig_hash:
            log.debug("save to %s: the ranks' plan signatures differ; gathering plans", self.root)
            return None
        try:
            d = derive.derive(rules.decode(own.signature), len(offers))
        except (derive.NotDerivable, ValueError) as e:
            log.debug("save to %s: plan not derivable (%s); gathering plans", self.root, e)
            return None
        bad = d.mismatch([o.plan_hash for o in offers])
        if bad is not None:
            log.warning("save to %s: the plan derived for rank %d differs from the boxes it "
                        "holds (its plan hash); planning from the gathered plans instead",
                        self.root, bad)
            return None
        if set(own.values) & set(d.plan.tensors):
            return None  # a key that is both: the gathered path names it
        return d.plan

    def begin(self, save_id: str) -> None:
        """Create the directory and take the save's lease (an intent file), before any
        rank writes a data file: gc leaves a save with a live intent alone. I/O."""
        self.storage.makedirs(self.root)
        self.save_id = save_id
        self.intent = Intent(self.storage, self.root, save_id).start()

    def _exists(self) -> AlreadyExistsError:
        return AlreadyExistsError(
            f"{self.root} already holds a committed checkpoint; pass overwrite=True "
            "to replace it (the old one stays intact until the new one commits)")

    def commit(self, votes: "Sequence[bytes] | Sequence[dict] | votes_mod.VoteTable",
               t0: float, meta: dict | None = None, created: float | None = None) -> bytes:
        """Write the manifest if every rank wrote its file and every file is still
        there; else remove this save's files. After a commit, remove the files of the
        checkpoint it replaced, and nothing else. ``votes``: as gathered (bytes,
        :mod:`dckpt.protocol.votes`), JSON-decoded, or a VoteTable; a malformed one
        fails the save as its rank's error. ``meta``, ``created``: more manifest meta
        and the commit time to record (a staged copy's: its local commit's). Cost at
        rank 0: O(world) numpy for the votes and the file table, plus the I/O."""
        try:
            table = votes_mod.table(votes, self.save_id)
            files = None if table.errors else table.files()
            if files is not None and self.gp is not None:
                votes_mod.check_writers(table, self.gp.bytes_per_rank)
            if files is not None:
                votes_mod.check_reports(table)
                votes_mod.check_side(table, self.side_prefix)
        except CheckpointError as e:  # a malformed vote: its rank's failure, everywhere
            return _pack({"errors": {r: {"type": "CheckpointError", "message": m}
                                     for r, m in e.failures.items()} or {0: error_payload(e)}})
        if table.errors:
            return _pack({"errors": table.errors})
        try:
            meta = {**(meta or {}), "dckpt_version": dckpt_version(),
                    "save_seconds": round(time.perf_counter() - t0, 3)}
            reports = {r: [delta.ChunkReport.from_json(x) for x in v["chunks"]]
                       for r, v in table.docs.items() if "chunks" in v}
            if self.base is not None:
                meta["base"] = self.base_dir
            if self.side_prefix:
                meta["side_prefix"] = self.side_prefix
            m = gplan.to_manifest(self.gp, files, self.save_id, self.world, meta,
                                  missing_ok=bool(reports),
                                  side=(self.side_prefix, table.side_rows()) if table.side
                                  else None)
            if reports:
                m = delta.attach(m, reports, self.base, self.base_dir)
            if created is not None:
                m = dataclasses.replace(m, created=created)
        except Exception as e:
            return _pack({"errors": {0: error_payload(e)}})
        return self.commit_manifest(m, t0)

    def commit_manifest(self, m: mf.Manifest, t0: float) -> bytes:
        """Check that every file ``m`` names is there, put ``m`` (THE commit point), then
        remove the files of the checkpoint it replaced. Returns the packed outcome."""
        st, root = self.storage, self.root
        try:
            data = mf.to_json(m)
            _faults.fault("commit", 0)
            _check_files(st, root, m.files)
            replaced = _current_files(st, root) if self.overwrite else set()
            if replaced:  # an incremental sibling may still reference them
                replaced -= referenced_by_siblings(st, root)
            try:
                st.put_atomic(st.join(root, mf.MANIFEST_NAME), data,  # THE commit point
                              exclusive=not self.overwrite)
            except FileExistsError:
                raise self._exists() from None
            self.committed = True
            _faults.fault("committed", 0)
            keep = set(m.files.names)
            _remove_files(st, root, lambda n: n in replaced and n not in keep)
            return _pack({"bytes": m.total_bytes, "files": len(m.files),
                          "seconds": time.perf_counter() - t0})
        except Exception as e:
            if not self.committed and self._manifest_is_ours():
                self.committed = True  # e.g. the directory fsync failed after the rename
            return _pack({"errors": {0: error_payload(e)}})

    def finish(self) -> None:
        """Always called on rank 0 at the end of a save, however it ended: removes this
        save's files unless it committed, then ends its lease. Never raises."""
        if self.intent is None:
            return
        try:
            if not self.committed:
                _remove_files(self.storage, self.root,
                              lambda n: n.startswith(save_files_prefixes(self.save_id)))
        finally:
            self.intent.end()
            self.intent = None

    def _manifest_is_ours(self) -> bool:
        """After a failed commit: did the manifest land anyway (e.g. the directory fsync
        failed after the rename)? Then this save's files must stay."""
        from .restore import read_manifest_bytes

        try:
            data = read_manifest_bytes(self.storage, self.root)  # bounded, regular file only
        except (OSError, CheckpointError):
            return False
        return f'"save_id":"{self.save_id}"'.encode() in data


def vote_files(votes: list[dict]) -> list[mf.FileEntry]:
    """The files the ranks' votes report, in rank order."""
    return [mf.FileEntry(v["file"], v["size"], v["hlen"], v["crc"], r)
            for r, v in enumerate(votes) if v.get("file")]


def dckpt_version() -> str:
    """This dckpt's version, recorded in every manifest it writes."""
    return __version__
