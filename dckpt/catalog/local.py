"""The fast tier seen from outside the job: a ``local_root`` and its steps, for the CLI.

A fast-tier step directory (``local_root/step-<N>/``, see docs/TIERS.md "What is
where") holds, for each rank of this node, ``data-<id>-<rank>.safetensors``,
``replica-<id>-<rank>.safetensors`` and that rank's view of the global manifest,
``manifest-<rank>.json``; there is no ``manifest.json``. It is recognised by those
views, so no flag is needed. A step is *complete on this node* when every rank of the
world size its views declare has a view here, all of one save, with its own files at
their recorded sizes: then a job of that size on this node alone can restore it. On a
multi-node job each node holds only its own ranks' views, so "incomplete" there names
the ranks present.

Torch-free and collective-free: JSON and listings only (``dckpt ls`` must not pay for
importing torch). The file names come from :mod:`dckpt.tiers.localnames`, shared with
:mod:`dckpt.tiers.local`, which writes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CheckpointError
from ..format import manifest as mf
from ..protocol.manifest_read import MAX_MANIFEST as _MAX_VIEW
from ..tiers.localnames import STEP_DIR, VIEW_FILE  # noqa: F401 (catalog uses STEP_DIR)
from ..tiers.localnames import view_name as mf_name

# local_root/peers/step-<N>/: the parts other nodes replicated here. The tier's own
# constant (dckpt.tiers.peers.part.PEERS) sits in a module that imports torch; a test
# keeps the two equal.
PEERS = "peers"


def view_ranks(names) -> list[int]:
    """The ranks whose view is among ``names`` (a directory's file names), ascending."""
    return sorted(int(m.group(1)) for n in names if (m := VIEW_FILE.match(n)))


def ranks_text(ranks) -> str:
    """``0-3``, ``0,2,5-7``: a short list of ranks, given as ranks or as (first, last)
    ranges (what :func:`missing_ranks` returns). Pure, O(len(ranks) log len(ranks))."""
    spans = sorted((r, r) if isinstance(r, int) else tuple(r) for r in ranks)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in merged) or "none"


def missing_ranks(held, world: int) -> list[tuple[int, int]]:
    """The ranks of ``range(world)`` not in ``held``, as (first, last) ranges. Pure,
    O(len(held) log len(held)): bounded by what a directory holds, never by ``world``,
    which a view declares (10**12 in a 230-byte file)."""
    out, nxt = [], 0
    for r in sorted(r for r in set(held) if 0 <= r < world):
        if r > nxt:
            out.append((nxt, r - 1))
        nxt = r + 1
    if nxt < world:
        out.append((nxt, world - 1))
    return out


@dataclass
class LocalStep:
    """One fast-tier step directory as this node holds it.

    ``views``: rank -> its parsed view (the readable ones); ``problems``: why the step is
    not usable here (unreadable views, views of different saves or world sizes, a
    missing or short file); ``sizes``: the directory's files and their bytes."""

    path: str  # as shown to the user
    where: str  # the storage path
    views: dict[int, mf.Manifest] = field(default_factory=dict)
    raw: dict[int, bytes] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return max((v.world_size for v in self.views.values()), default=0)

    @property
    def first(self) -> mf.Manifest | None:
        """The lowest rank's view (every view carries the whole global manifest)."""
        return self.views[min(self.views)] if self.views else None

    @property
    def missing(self) -> list[tuple[int, int]]:
        """The ranks of the declared world with no view here, as (first, last) ranges
        (see :func:`missing_ranks`: never a list as long as the world)."""
        return missing_ranks(self.views, self.world_size)

    @property
    def complete(self) -> bool:
        return bool(self.views) and not self.problems and not self.missing

    def held_files(self, rank: int) -> list[int]:
        """Indices, in ``rank``'s view, of the files that rank wrote (its data and
        replica files): what this node must hold for it."""
        return [i for i, f in enumerate(self.views[rank].files) if f.rank == rank and not f.dir]

    @property
    def bytes(self) -> int:
        """Bytes of the files this node holds for the views here."""
        names = {self.views[r].files[i].name for r in self.views for i in self.held_files(r)}
        return sum(self.sizes.get(n, 0) for n in names) + sum(
            self.sizes.get(mf_name(r), 0) for r in self.views)

    @property
    def files(self) -> int:
        return len({self.views[r].files[i].name for r in self.views for i in self.held_files(r)})

    def state(self) -> str:
        """``complete on this node`` or what is wrong or missing, one line."""
        if self.problems:
            return "; ".join(self.problems)
        if self.missing:
            return (f"incomplete on this node: views of rank(s) {ranks_text(self.views)} of "
                    f"{self.world_size}, not {ranks_text(self.missing)} (on other nodes, or "
                    "a save that did not finish)")
        return "complete on this node"


def read_local_step(storage, where: str, shown: str, names: dict[str, int] | None = None
                    ) -> LocalStep:
    """Read every rank's view in the fast-tier step ``where`` and check that they agree
    (one save id, one world size, ranks below it) and that each rank's own files are
    present at their recorded sizes. ``names``: the directory's listing ({name: size})
    when the caller has it. Blocking I/O: one listing (unless given) and one small read
    per view; no data file is read. Never raises for a damaged step (see ``problems``);
    OSError from the storage propagates."""
    if names is None:
        names = {e.name: e.size for e in storage.listdir(where) if not e.is_dir}
    step = LocalStep(shown, where, sizes=dict(names))
    for r in view_ranks(names):
        path = storage.join(where, mf_name(r))
        try:
            raw = storage.read_file(path, _MAX_VIEW)
            step.views[r] = mf.parse(raw, path)
            step.raw[r] = raw
        except (CheckpointError, OSError) as e:
            step.problems.append(f"rank {r}'s view {mf_name(r)} is unreadable: {e}")
    ids = {r: v.save_id for r, v in step.views.items()}
    if len(set(ids.values())) > 1:
        step.problems.append("views of different saves (a save that did not finish on "
                             "every rank): " + ", ".join(f"rank {r}: {i}" for r, i in ids.items()))
    worlds = {v.world_size for v in step.views.values()}
    if len(worlds) > 1:
        step.problems.append(f"views declare different world sizes {sorted(worlds)}")
    for r, v in step.views.items():
        if r >= v.world_size:
            step.problems.append(f"rank {r}'s view is of a save of {v.world_size} ranks")
        for i in step.held_files(r):
            f = v.files[i]
            if names.get(f.name) != f.size:
                got = "missing" if f.name not in names else f"{names[f.name]} bytes"
                step.problems.append(f"rank {r}: {f.name} is {got}, its view says {f.size} bytes")
    return step


def is_local_step(names) -> bool:
    """Whether a directory listing is a fast-tier step's: rank views, no manifest.json."""
    return mf.MANIFEST_NAME not in names and any(VIEW_FILE.match(n) for n in names)


def holds_local_step(storage, where: str) -> bool:
    """Whether ``where`` is a fast-tier step directory. One listing; False when it
    cannot be listed."""
    try:
        return is_local_step([e.name for e in storage.listdir(where) if not e.is_dir])
    except OSError:
        return False
