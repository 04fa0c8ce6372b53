"""The transfer primitive of the replicated fast tier (issue 28): one file streamed from
one rank to another, point to point, on dckpt's own gloo group, in bounded pieces,
verified on arrival. Not wired into the manager yet (see peerplan.py for the plan).

Wire protocol (every message is a uint8/int64 CPU tensor; no pickle). A *control* is
an int64 pair ``(kind, n)``, followed by ``n`` bytes for every kind but DATA::

    sender                                  receiver
    HEAD {"size", "name"}  or FAIL {error}  ->
                                            <-  OK  or FAIL {why it refuses}
    DATA n, n bytes   (repeated)  or FAIL   ->
                                            <-  OK  or FAIL {why it rejects the file}

Every step has exactly one reply or none, so a failure on either side is a message the
other side is waiting for: both raise, neither waits out the group's timeout. Only a
dead peer (or a wedged link) does, and that raises CommunicationError when the gloo
group's timeout expires.

The receiver writes under a temporary name in the destination directory, verifies the
whole file against the CRCs in its own shard header (the checks ``dckpt verify`` runs),
and only then renames it over the final name: a failed or partial transfer leaves
nothing under that name. A receiver killed mid-transfer can leave a dot-named
``*.peer-*.tmp`` file behind (never a file under the final name).
"""
from __future__ import annotations

import json
import os
import struct
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...errors import ERROR_TYPES, CheckpointError, CommunicationError, IntegrityError
from ...format import shards
from ...storage.rename import replace_file
from ...protocol.collectives import OwnGroup, error_payload
from ...catalog.verify import check_tensor
from .streamcheck import StreamCheck

PIECE = 8 << 20  # bytes per piece: the memory a transfer holds on each rank (smaller
# pieces overlap the sender's reads and the receiver's CRCs and writes with the wire; 8 MiB
# restored a 100 MiB part ~10% faster than 64 MiB, in an eighth of the memory)
CAP = 1 << 40  # default largest file a receiver accepts
_MAX_CTL = 1 << 20  # a control payload (JSON) larger than this is a broken peer
_DATA, _FAIL, _HEAD, _OK = 0, 1, 2, 3
_U64 = struct.Struct("<Q")


class _Link:
    """Point-to-point sends and receives with one peer of ``group`` (an OwnGroup or a
    registered gloo group, None: the default group, which must then be gloo; ``peer``
    is a rank of that group: CPU tensors only). Every operation blocks
    and raises CommunicationError naming the file and the peer."""

    def __init__(self, group: Any, peer: int, file: str) -> None:
        self.own = group if isinstance(group, OwnGroup) else None
        self.group = None if self.own is not None else (group or dist.group.WORLD)
        self.peer, self.file = peer, file
        self.dst = peer if self.own is not None else dist.get_global_rank(self.group, peer)

    def _run(self, what: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # DistBackendError (timeout, dead peer), RuntimeError
            raise CommunicationError(
                f"peer transfer of {self.file}: {what} rank {self.peer} failed: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (the peer "
                "died, hung past the group's timeout, or the group was destroyed)") from e

    def send(self, t: torch.Tensor) -> None:
        if self.own is not None:
            self._run("send to", lambda: self.own.pg.send([t], self.dst, 0).wait())
        else:
            self._run("send to", lambda: dist.send(t, dst=self.dst, group=self.group))

    def recv(self, t: torch.Tensor) -> None:
        if self.own is not None:
            self._run("receive from", lambda: self.own.pg.recv([t], self.dst, 0).wait())
        else:
            self._run("receive from", lambda: dist.recv(t, src=self.dst, group=self.group))

    def send_ctl(self, kind: int, payload: bytes = b"", n: int | None = None) -> None:
        """A control ``(kind, n)``, then ``payload`` (for every kind but DATA)."""
        self.send(torch.tensor([kind, len(payload) if n is None else n], dtype=torch.int64))
        if payload:
            self.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def recv_ctl(self) -> tuple[int, int, bytes]:
        """(kind, n, payload); a DATA control's ``n`` bytes are left for the caller.
        Raises CheckpointError on a control no dckpt peer sends."""
        t = torch.empty(2, dtype=torch.int64)
        self.recv(t)
        kind, n = int(t[0]), int(t[1])
        if kind not in (_DATA, _FAIL, _HEAD, _OK) or n < 0 or (kind != _DATA and n > _MAX_CTL):
            raise CheckpointError(f"peer transfer of {self.file}: rank {self.peer} sent a "
                                  f"malformed control ({kind}, {n}): not a dckpt peer, or a "
                                  "different dckpt version")
        if kind == _DATA or n == 0:
            return kind, n, b""
        buf = torch.empty(n, dtype=torch.uint8)
        self.recv(buf)
        return kind, n, buf.numpy().tobytes()

    def fail(self, exc: BaseException) -> None:
        """Tell the peer this side failed (best effort: a dead link is already known)."""
        try:
            self.send_ctl(_FAIL, json.dumps(error_payload(exc)).encode())
        except CommunicationError:
            pass

    def raise_remote(self, payload: bytes, role: str) -> None:
        """Raise the peer's FAIL ``payload`` here, typed like the peer's error."""
        try:
            doc = json.loads(payload)
            cls, msg = ERROR_TYPES.get(doc["type"], CheckpointError), str(doc["message"])
        except (ValueError, KeyError, TypeError):
            cls, msg = CheckpointError, payload[:200].decode(errors="replace")
        raise cls(f"peer transfer of {self.file}: the {role} (rank {self.peer}) failed: {msg}")


def send_file(group: Any, storage, path: str, dst: int, piece: int = PIECE) -> int:
    """Send the file ``path`` of ``storage`` to rank ``dst`` of ``group``, which calls
    :func:`recv_file` for it at the same time. Returns the bytes sent.

    Cost: blocking, point to point (no other rank takes part); reads the file once, in
    pieces of at most ``piece`` bytes into one reused buffer (memory: one piece).
    A file this rank cannot read (missing, unreadable, shrinking) is reported to the
    receiver in place of the data, so it raises rather than waits.
    Raises CheckpointError naming the file and the peer when this side cannot read the
    file (FileNotFoundError and OSError are wrapped), the receiver's error (typed like
    it: IntegrityError when the file failed its checksums there) when the receiver
    refused or rejected the file, CommunicationError when the link failed."""
    link = _Link(group, dst, path)
    try:
        if piece <= 0:
            raise ValueError(f"piece must be > 0, got {piece}")
        size = storage.size(path)
        reader = storage.open_read(path)
    except Exception as e:
        err = CheckpointError(f"peer transfer of {path} to rank {dst}: the sender cannot "
                              f"read it: {type(e).__name__}: {e}")
        link.fail(err)
        raise err from e
    with reader:
        link.send_ctl(_HEAD, json.dumps({"size": size, "piece": piece,
                                         "name": os.path.basename(path)}).encode())
        kind, _, payload = link.recv_ctl()
        if kind == _FAIL:
            link.raise_remote(payload, "receiver")
        buf = torch.empty(min(piece, size) or 1, dtype=torch.uint8)
        stream(link, reader, buf, 0, size, f"peer transfer of {path} to rank {dst}")
    kind, _, payload = link.recv_ctl()
    if kind == _FAIL:
        link.raise_remote(payload, "receiver")
    return size


def stream(link: _Link, reader, buf: torch.Tensor, off: int, length: int, what: str) -> None:
    """Send bytes ``[off, off + length)`` of ``reader`` as DATA pieces of at most
    ``len(buf)`` bytes, read into ``buf`` (reused: memory one piece). A read that fails
    or comes up short (the file shrank) is sent to the peer as FAIL and raised here as
    CheckpointError, ``what`` naming the transfer. Blocking, point to point."""
    view = memoryview(buf.numpy())
    pos, end = off, off + length
    while pos < end:
        n = min(len(view), end - pos)
        try:
            got = reader.readv(pos, [view[:n]])
            if got != n:
                raise OSError(f"the file ended at byte {pos + max(got, 0)}, before byte "
                              f"{end} (it shrank while being sent)")
        except Exception as e:
            err = CheckpointError(f"{what}: the sender cannot read it at byte {pos}: "
                                  f"{type(e).__name__}: {e}")
            link.fail(err)
            raise err from e
        link.send_ctl(_DATA, n=n)
        link.send(buf[:n])
        pos += n


def recv_file(group: Any, storage, path: str, src: int, piece: int = PIECE, cap: int = CAP,
              verify: Callable[[Any, str], None] | None = None) -> int:
    """Receive the file that rank ``src`` of ``group`` sends with :func:`send_file` and
    put it at ``path`` of ``storage`` (its directory must exist). Returns its size.

    The file arrives under a temporary name beside ``path``, is verified whole
    (``verify(storage, tmp)``, or by default :class:`StreamCheck`: what
    :func:`verify_shard` checks, every block against the shard header's own CRC32s,
    computed as the pieces arrive) and only then renamed over ``path`` in one step. A
    refused, failed or partial transfer leaves nothing under ``path`` (an existing file
    there is untouched), and the sender learns why and raises too.

    Cost: blocking, point to point; writes the file once (a ``verify`` given reads it
    back once); memory: one piece of at most ``piece`` bytes (the sender's piece size
    decides: a larger one is refused).
    Raises CheckpointError naming the file and the peer: the sender could not read its
    file, the size is over ``cap``, the sender names another file, or the file could not
    be written here; IntegrityError when it fails its checksums or is not a shard;
    CommunicationError when the link failed."""
    link = _Link(group, src, path)
    kind, _, payload = link.recv_ctl()
    if kind == _FAIL:
        link.raise_remote(payload, "sender")
    try:
        try:
            head = json.loads(payload) if kind == _HEAD else None
            size, name, theirs = int(head["size"]), str(head["name"]), int(head["piece"])
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"peer transfer of {path}: rank {src} sent no valid header "
                                  f"(control {kind})") from None
        if name != os.path.basename(path):
            raise CheckpointError(f"peer transfer of {path}: rank {src} sends {name!r}, not "
                                  f"{os.path.basename(path)!r} (the ranks planned different "
                                  "transfers)")
        if not 0 <= size <= cap:
            raise CheckpointError(f"peer transfer of {path}: rank {src} sends {size} bytes, "
                                  f"over this receiver's {cap}-byte cap; refused")
        if piece <= 0 or theirs <= 0 or min(theirs, size) > min(piece, size):
            raise CheckpointError(f"peer transfer of {path}: rank {src} sends pieces of "
                                  f"{theirs} bytes, this receiver takes {piece}; refused")
        tmp = os.path.join(os.path.dirname(path),
                           f".{os.path.basename(path)}.peer-{uuid.uuid4().hex[:12]}.tmp")
        writer = storage.open_write(tmp, size_hint=size)
    except Exception as e:
        err = e if isinstance(e, CheckpointError) else CheckpointError(
            f"peer transfer of {path} from rank {src}: cannot write it here: "
            f"{type(e).__name__}: {e}")
        link.fail(err)
        raise err from (None if err is e else e)
    local: BaseException | None = None
    committed = False
    check = StreamCheck(tmp, size) if verify is None else None
    try:
        link.send_ctl(_OK)  # go: the sender streams the pieces now
        buf = torch.empty(min(piece, size) or 1, dtype=torch.uint8)
        pos = 0
        while pos < size:
            kind, n, payload = link.recv_ctl()
            if kind == _FAIL:
                link.raise_remote(payload, "sender")
            if kind != _DATA or not 0 < n <= min(len(buf), size - pos):
                raise CheckpointError(f"peer transfer of {path}: rank {src} sent control "
                                      f"({kind}, {n}) at byte {pos} of {size}, not a piece "
                                      f"of at most {len(buf)} bytes; the link is out of step")
            link.recv(buf[:n])
            if local is None:  # after a local failure: drain the pieces, then say so
                try:
                    data = memoryview(buf.numpy())[:n]
                    if check is not None:  # the CRCs as the bytes pass: no read-back
                        check.feed(data, pos)
                    writer.write(data)
                except Exception as e:
                    local = e
            pos += n
        try:
            if local is not None:
                raise local
            writer.commit()
            committed = True
            if check is not None:
                check.finish()
            else:
                verify(storage, tmp)
            replace_file(storage, tmp, path)
            tmp = None
        except Exception as e:
            if isinstance(e, CheckpointError):  # IntegrityError from the checks stays one
                err = type(e)(f"peer transfer of {path} from rank {src}: {e}")
            else:
                err = CheckpointError(f"peer transfer of {path} from rank {src}: cannot "
                                      f"write it here: {type(e).__name__}: {e}")
            link.fail(err)
            raise err from e
        link.send_ctl(_OK)
    finally:
        if tmp is not None:
            _remove_quietly(storage, writer, tmp, committed)
    return size


def refuse_file(group: Any, path: str, src: int, err: BaseException) -> None:
    """Answer the :func:`send_file` of ``path`` that rank ``src`` is starting with
    ``err``: this receiver cannot take it (it failed between two files of a batch), so
    the sender raises instead of waiting for a reply. Blocking, point to point; never
    raises but CommunicationError."""
    link = _Link(group, src, path)
    kind, _, _ = link.recv_ctl()
    if kind != _FAIL:  # the sender's own failure needs no answer
        link.fail(err)


def fail_file(group: Any, path: str, dst: int, err: BaseException) -> None:
    """Start the :func:`send_file` of ``path`` to rank ``dst`` with ``err`` in place of
    its header: this sender cannot send it, so the receiver raises ``err`` instead of
    waiting. Blocking, point to point; never raises."""
    _Link(group, dst, path).fail(err)


def _remove_quietly(storage, writer, tmp: str, committed: bool) -> None:
    """Drop the temporary file of a failed transfer (never raises: the transfer's own
    error is what the caller must see)."""
    if not committed:
        writer.abort()
        return
    try:
        storage.remove(tmp)
    except OSError:
        pass


def verify_shard(storage, path: str) -> None:
    """Check that ``path`` is a whole dckpt shard file: a readable header with CRCs,
    tensors that tile the data region exactly, and every block of every tensor against
    its CRC (:func:`dckpt.catalog.verify.check_tensor`, what ``dckpt verify`` runs). Blocking
    I/O: reads the file once; memory: one 64 MiB read. Raises IntegrityError naming
    ``path`` and what failed."""
    try:
        size = storage.size(path)
        if size < 8:
            raise IntegrityError(f"shard file {path}: {size} bytes, shorter than a header")
        (hlen,) = _U64.unpack(storage.read(path, 0, 8))
        if hlen > min(shards.MAX_HEADER, size - 8):
            raise IntegrityError(f"shard file {path}: header length {hlen} does not fit "
                                 f"the file ({size} bytes)")
        tensors, block = shards.parse_header(storage.read(path, 0, 8 + hlen), path, size)
        pos = 8 + hlen
        for st in sorted(tensors.values(), key=lambda st: st.start):
            if st.start != pos:
                raise IntegrityError(f"shard file {path}: bytes {pos}..{st.start - 1} are "
                                     "not described by its header")
            check_tensor(storage, path, st, block)
            pos += st.nbytes
        if pos != size:
            raise IntegrityError(f"shard file {path}: bytes {pos}..{size - 1} are not "
                                 "described by its header")
    except IntegrityError:
        raise
    except CheckpointError as e:  # check_tensor's checksum mismatch or truncation
        raise IntegrityError(str(e)) from None
    except OSError as e:
        raise IntegrityError(f"shard file {path}: unreadable: {e}") from e
