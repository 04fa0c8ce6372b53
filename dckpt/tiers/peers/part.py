"""The parts of a fast-tier step that a node holds, and a part's transfer between two
ranks (issue 28, the replicated fast tier).

A *part* of a local step is one saving rank's files of it: its view
``manifest-<p>.json`` and the data files that view says rank p wrote (``data-`` and,
when it held replicated chunks, ``replica-``). A node holds its own ranks' parts in
``local_root/step-<N>/`` (where the fast tier writes them) and the parts other nodes
replicated to it in ``local_root/peers/step-<N>/``, under the same names (every name
carries its rank, so parts of many nodes share one directory).

A part counts as held once its view is there, names this root's run, and its files are
there at the sizes the view records. A received part's files were checked against their
CRCs on arrival (:func:`dckpt.tiers.peers.xfer.recv_file`) and its view arrives last, so
a transfer cut short holds nothing; own parts were checked when written. Bytes damaged
later are caught where they are used: a transfer verifies again on the receiving side,
and a load verifies every block it reads.

Blocking local I/O only; the transfers are point to point on a gloo group.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass

from ... import _faults
from ...errors import CheckpointError
from ...format import manifest as mf
from ...protocol.restore import MAX_MANIFEST
from ..localnames import STEP_DIR, VIEW_FILE, step_name, view_name
from .xfer import PIECE, fail_file, recv_file, refuse_file, send_file

log = logging.getLogger(__name__)
PEERS = "peers"  # under local_root: the parts other nodes replicated here
INCOMING = ".incoming"  # under a step directory: views in transit (never read as held)
_PART_FILE = re.compile(r"^(?:data|replica)-([0-9a-f]{16})-(\d{5,})\.safetensors$")


def peers_dir(storage, root: str, step: int) -> str:
    return storage.join(root, PEERS, step_name(step))


@dataclass(frozen=True)
class Part:
    """A part held in ``where`` (a step directory): its view and the step it is of."""

    step: int
    part: int
    where: str
    view: mf.Manifest

    @property
    def files(self) -> list[mf.FileEntry]:
        return part_files(self.view, self.part)


class Missing(Part):
    """A part that is not held where it should be: sending it fails at its view, on
    both sides, naming it."""

    @property
    def files(self) -> list[mf.FileEntry]:
        return []


def part_files(view: mf.Manifest, part: int) -> list[mf.FileEntry]:
    """The data files of ``part`` that ``view`` (part ``part``'s own view) names, in
    manifest order (the order a transfer sends them). Pure."""
    return [f for f in view.files if f.rank == part and not f.dir]


def read_part(storage, where: str, part: int, owner: str | None) -> mf.Manifest:
    """Part ``part``'s view in the step directory ``where``, after checking that it is
    a view of that part for the root ``owner`` and that its files are there at their
    recorded sizes. Small I/O (the view, one listing). Raises FileNotFoundError when
    the view is absent, CheckpointError naming what is wrong otherwise."""
    path = storage.join(where, view_name(part))
    view = mf.parse(storage.read_file(path, MAX_MANIFEST), path)
    if view.meta.get("view_of_rank") != part:
        raise CheckpointError(f"{path} is not part {part}'s view")
    if view.meta.get("owner") != owner:
        raise CheckpointError(f"{path} was saved for another durable root "
                              f"({view.meta.get('owner')}, not {owner})")
    sizes = {e.name: e.size for e in storage.listdir(where)}
    for f in part_files(view, part):
        if sizes.get(f.name) != f.size:
            raise CheckpointError(f"{storage.join(where, f.name)} is missing or has the "
                                  f"wrong size ({sizes.get(f.name)}, not {f.size})")
    return view


def scan(storage, root: str, owner: str | None) -> list[Part]:
    """Every part held under ``root``: the fast tier's own step directories and
    ``peers/``. Parts that fail :func:`read_part` are left out with an info log saying
    why. Small I/O per part (its view). Never raises."""
    out: list[Part] = []
    for base in (root, storage.join(root, PEERS)):
        try:
            entries = storage.listdir(base)
        except OSError:
            continue
        for e in entries:
            m = STEP_DIR.match(e.name)
            if not (m and e.is_dir):
                continue
            where = storage.join(base, e.name)
            try:
                names = [x.name for x in storage.listdir(where)]
            except OSError:
                continue
            for n in names:
                v = VIEW_FILE.match(n)
                if not v:
                    continue
                p = int(v.group(1))
                try:
                    out.append(Part(int(m.group(1)), p, where, read_part(storage, where, p, owner)))
                except FileNotFoundError:
                    continue
                except (OSError, CheckpointError) as err:
                    log.info("part %d in %s is not usable: %s", p, where, err)
    return out


def find(parts: list[Part], step: int, save_id: str, part: int) -> Part | None:
    """The held part ``part`` of ``step`` from the save ``save_id``, own copy first."""
    hits = [x for x in parts if x.step == step and x.part == part and x.view.save_id == save_id]
    hits.sort(key=lambda x: PEERS in x.where.split("/"))
    return hits[0] if hits else None


# ----------------------------------------------------------------------------- transfer

def send_part(group, storage, held: Part, dst: int, piece: int = PIECE) -> int:
    """Send ``held`` to rank ``dst`` of ``group``, which calls :func:`recv_part` for it
    at the same time: the view first (the receiver learns the files from it), then its
    data files in view order. Returns the bytes sent. Blocking, point to point; memory
    one piece. Raises what :func:`~dckpt.tiers.peers.xfer.send_file` raises (the
    receiver's error too: IntegrityError when a file failed its checks there)."""
    if isinstance(held, Missing):
        # Its view may still be there (a data file gone): sending it would leave the
        # receiver waiting for files this side never sends. Fail at the view instead.
        err = CheckpointError(f"part {held.part} of step {held.step} is not held whole in "
                              f"{held.where}; cannot send it to rank {dst}")
        fail_file(group, storage.join(held.where, view_name(held.part)), dst, err)
        raise err
    n = send_file(group, storage, storage.join(held.where, view_name(held.part)), dst, piece)
    for f in held.files:
        n += send_file(group, storage, storage.join(held.where, f.name), dst, piece)
    return n


def recv_part(group, storage, where: str, part: int, src: int, save_id: str,
              owner: str | None, piece: int = PIECE, me: int = -1) -> int:
    """Receive part ``part`` of the save ``save_id`` from rank ``src`` (who calls
    :func:`send_part`) into the step directory ``where`` (created). The view arrives
    under ``where/.incoming/``, each data file is verified whole on arrival, and the
    view is moved to its place last: until then the part is not held here, and a
    transfer cut short leaves only dot-named files (removed by :func:`sweep`). Files
    of an older save of this part in ``where`` are removed once the new one is held.
    Returns the bytes received (``me``: this rank, for fault injection only).
    Blocking, point to point; memory one piece. Raises
    CheckpointError (IntegrityError for a damaged file) naming the file and the peer;
    the sender raises too, so neither waits."""
    incoming = storage.join(where, INCOMING)
    tmp_view = storage.join(incoming, view_name(part))

    got: list[mf.Manifest] = []  # the view as checked on arrival (never read twice)

    def check_view(st, path: str) -> None:
        v = mf.parse(st.read_file(path, MAX_MANIFEST), path)
        got.append(v)
        if v.save_id != save_id or v.meta.get("view_of_rank") != part \
                or v.meta.get("owner") != owner:
            raise CheckpointError(f"{path}: the sender's view is of save {v.save_id} part "
                                  f"{v.meta.get('view_of_rank')}, not {save_id} part {part}")

    def local_failure(e: Exception, next_file: str | None) -> CheckpointError:
        """A failure here between two files: the sender is about to send ``next_file``
        (None: nothing more) and must hear of it rather than wait."""
        err = e if isinstance(e, CheckpointError) else CheckpointError(
            f"receiving part {part} from rank {src} into {where}: {type(e).__name__}: {e}")
        if next_file is not None:
            refuse_file(group, next_file, src, err)
        return err

    try:
        storage.makedirs(incoming)
    except Exception as e:
        raise local_failure(e, tmp_view) from e
    n = recv_file(group, storage, tmp_view, src, piece, MAX_MANIFEST, verify=check_view)
    view = got[-1]
    files = [storage.join(where, f.name) for f in part_files(view, part)]
    for i, path in enumerate(files):
        n += recv_file(group, storage, path, src, piece)
        try:
            _faults.fault("replicate", me)  # crash tests: a kill with the part half-received
        except Exception as e:
            raise local_failure(e, files[i + 1] if i + 1 < len(files) else None) from e
    os.replace(tmp_view, storage.join(where, view_name(part)))  # the part is held from here
    _drop_other_saves(storage, where, part, save_id)
    return n


def _drop_other_saves(storage, where: str, part: int, save_id: str) -> None:
    """Remove ``part``'s data files of other saves in ``where`` (a step saved again
    after a rewind). Never raises."""
    try:
        for e in storage.listdir(where):
            m = _PART_FILE.match(e.name)
            if m and int(m.group(2)) == part and m.group(1) != save_id:
                storage.remove(storage.join(where, e.name))
    except OSError as err:
        log.debug("could not remove an older save of part %d in %s: %s", part, where, err)


def link_into(storage, held: Part, where: str) -> None:
    """Make ``held`` (found under ``peers/``) a part of the own step directory
    ``where`` too: hard links (the same bytes, no copy; a copy across file systems),
    the view last. Blocking local I/O. Raises OSError."""
    os.makedirs(where, exist_ok=True)
    for name in [f.name for f in held.files] + [view_name(held.part)]:
        src, dst = os.path.join(held.where, name), os.path.join(where, name)
        tmp = os.path.join(where, f".{name}.link")
        if os.path.exists(tmp):
            os.remove(tmp)
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)


# ----------------------------------------------------------------------------- upkeep

def sweep(root: str) -> int:
    """Remove what transfers cut short left under ``root`` (``*.peer-*.tmp`` files,
    ``.incoming`` views, half-made links, ``.restore-*`` directories). Call only while no transfer runs into
    ``root`` (at the tier's construction, collective, before any save). Returns the
    number of files removed. Never raises."""
    n = 0
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith(".restore-"):  # a resharded restore's reads, cut short
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            n += 1
    for base, dirs, files in os.walk(root):
        for name in files:
            if (".peer-" in name and name.endswith(".tmp")) or name.endswith(".link") \
                    or os.path.basename(base) == INCOMING:
                try:
                    os.remove(os.path.join(base, name))
                    n += 1
                except OSError:
                    pass
    return n


def drop_peer_steps(root: str, steps: list[int]) -> None:
    """Remove ``peers/step-<N>`` for each N in ``steps``. Never raises."""
    for s in steps:
        shutil.rmtree(os.path.join(root, PEERS, step_name(s)), ignore_errors=True)


def peer_steps(root: str) -> list[int]:
    """The steps with a directory under ``peers/``, ascending. Never raises."""
    try:
        names = os.listdir(os.path.join(root, PEERS))
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(STEP_DIR.match, names) if m)
