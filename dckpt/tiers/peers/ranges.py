"""Byte ranges of a shard file from a peer (issue 28, restore at another world size): a
rank that needs only some chunks of a file another node holds receives the header and
those chunks' bytes and writes them into a SPARSE local copy (full size, holes
elsewhere). The ordinary load then reads it: it reads only the header (checked against
the manifest's FileEntry) and the chunks it needs (checked against their CRCs).

Same link and discipline as :mod:`peerxfer` (every step has exactly one reply, so a
failure on either side is a message the other side is waiting for)::

    sender                                          receiver
    HEAD {"name", "size", "piece", "ranges"}  or FAIL ->
                                                    <-  OK  or FAIL {why it refuses}
    DATA n, n bytes (ranges in order)  or FAIL       ->
                                                    <-  OK  or FAIL {why it rejects them}

The receiver writes under a dot-named ``.<name>.peer-<hex>.tmp`` beside the final path,
verifies the header against the FileEntry and every requested chunk against its CRCs,
then renames it over the final path: a failed transfer leaves nothing under that name.
"""
from __future__ import annotations

import bisect
import json
import os
import uuid
from typing import Any

import torch

from ...errors import CheckpointError, IntegrityError
from ...format import shards
from ...format.checksum import crc32
from ...format.chunknames import checked_stored
from .xfer import _DATA, _FAIL, _HEAD, _MAX_CTL, _OK, _U64, PIECE, _Link, stream

Chunk = tuple[str, tuple[int, ...]]


def _what(key: str, offsets) -> str:
    return f"chunk {key!r} at offsets {tuple(int(o) for o in offsets)}"


def _find(tensors: dict, path: str, key: str, offsets, chunks: list[Chunk]):
    """The stored tensor of chunk (key, offsets) of ``chunks`` in the parsed header of
    ``path``, checked against the offsets the file records (:func:`checked_stored`;
    for a file that records none, the requested chunks of ``key`` there are the count:
    two or more are refused, and the load that reads them checks the manifest's).
    O(ndim) (O(len(chunks)) for such a file). Raises CheckpointError when the file
    holds no such chunk, IntegrityError when it holds another."""
    st = checked_stored(tensors, key, offsets, path,
                        lambda: sum(1 for k, _ in chunks if k == key))
    if st is None:
        raise CheckpointError(f"shard file {path} holds no {_what(key, offsets)}")
    return st


def _coalesce(spans: list[tuple[int, int]]) -> list[list[int]]:
    """Sorted ``[off, len]`` ranges covering ``spans`` ((off, len) pairs), adjacent or
    overlapping ones merged (fewer, larger reads and a small HEAD). Pure."""
    out: list[list[int]] = []
    for off, n in sorted(s for s in spans if s[1] > 0):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + n - out[-1][0])
        else:
            out.append([off, n])
    return out


def send_ranges(group: Any, storage, path: str, chunks: list[Chunk], dst: int,
                piece: int = PIECE) -> int:
    """Send the header of the shard file ``path`` of ``storage`` and the stored bytes of
    each (key, offsets) in ``chunks`` to rank ``dst`` of ``group``, which calls
    :func:`recv_ranges` with the same ``chunks`` at the same time. Returns bytes sent.

    Cost: blocking, point to point (no other rank takes part); reads the header and
    those bytes once, in pieces of at most ``piece`` bytes into one reused buffer
    (memory: one piece). Raises CheckpointError naming the file, the chunk and the peer
    when this side cannot read the file or it holds no such chunk (IntegrityError when
    its header is unreadable); the receiver's error, typed like it (IntegrityError for
    damage found there), when it refused or rejected the bytes; CommunicationError when
    the link failed. The receiver is told of every failure here, so it raises too."""
    link = _Link(group, dst, path)
    try:
        if piece <= 0:
            raise ValueError(f"piece must be > 0, got {piece}")
        size = storage.size(path)
        (hlen,) = _U64.unpack(storage.read(path, 0, 8)) if size >= 8 else (-1,)
        if not 0 <= hlen <= min(shards.MAX_HEADER, size - 8):
            raise IntegrityError(f"shard file {path}: {size} bytes, no header fits")
        tensors, _ = shards.parse_header(storage.read(path, 0, 8 + hlen), path, size)
        spans = [(0, 8 + hlen)]
        for key, offsets in chunks:
            st = _find(tensors, path, key, offsets, chunks)
            spans.append((st.start, st.nbytes))
        ranges = _coalesce(spans)
        head = json.dumps({"name": os.path.basename(path), "size": size, "piece": piece,
                           "ranges": ranges}).encode()
        if len(head) > _MAX_CTL:  # the receiver would take it for a broken peer
            raise CheckpointError(f"{len(ranges)} byte ranges of {path} do not fit one "
                                  f"transfer's {_MAX_CTL}-byte header; send the whole file")
        reader = storage.open_read(path)
    except Exception as e:
        cls = IntegrityError if isinstance(e, IntegrityError) else CheckpointError
        err = cls(f"peer transfer of ranges of {path} to rank {dst}: the sender cannot "
                  f"send them: {e if isinstance(e, CheckpointError) else repr(e)}")
        link.fail(err)
        raise err from e
    with reader:
        link.send_ctl(_HEAD, head)
        kind, _, payload = link.recv_ctl()
        if kind == _FAIL:
            link.raise_remote(payload, "receiver")
        buf = torch.empty(min(piece, max(n for _, n in ranges)), dtype=torch.uint8)
        for off, length in ranges:
            stream(link, reader, buf, off, length,
                   f"peer transfer of ranges of {path} to rank {dst}")
    kind, _, payload = link.recv_ctl()
    if kind == _FAIL:
        link.raise_remote(payload, "receiver")
    return sum(n for _, n in ranges)


def _check_head(payload: bytes, kind: int, path: str, entry, piece: int) -> tuple[list, int]:
    """The ranges and piece size of a sender's HEAD, refused (CheckpointError) unless it
    names this file at the manifest's size, with sorted, disjoint ranges inside it whose
    first covers the header, in pieces no larger than this receiver takes."""
    try:
        head = json.loads(payload) if kind == _HEAD else None
        name, size, theirs = str(head["name"]), int(head["size"]), int(head["piece"])
        ranges = [(int(a), int(b)) for a, b in head["ranges"]]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"sent no valid header (control {kind})") from None
    if name != os.path.basename(path):
        raise CheckpointError(f"sends {name!r}, not {os.path.basename(path)!r} (the ranks "
                              "planned different transfers)")
    if size != entry.size:
        raise CheckpointError(f"the sender's file has {size} bytes, the manifest recorded "
                              f"{entry.size} (a different save or a replaced file); refused")
    end = 0
    for a, n in ranges:
        if a < end or n <= 0 or a + n > size:
            raise CheckpointError(f"sends byte ranges that are unsorted, overlapping or "
                                  f"outside the {size}-byte file ({a}, {n}); refused")
        end = a + n
    if not ranges or ranges[0][0] != 0 or ranges[0][1] < 8 + entry.header_len:
        raise CheckpointError("sends ranges that do not start with the file's header")
    most = max(n for _, n in ranges)
    if piece <= 0 or theirs <= 0 or min(theirs, most) > min(piece, most):
        raise CheckpointError(f"sends pieces of {theirs} bytes, this receiver takes "
                              f"{piece}; refused")
    return ranges, min(piece, most)


def recv_ranges(group: Any, path: str, entry, chunks: list[Chunk], src: int,
                piece: int = PIECE) -> int:
    """Receive what rank ``src`` of ``group`` sends with :func:`send_ranges` (the same
    ``chunks``) into a sparse copy of the shard file at the LOCAL path ``path``
    (``entry``: the manifest's FileEntry of that file; its directory must exist).
    Returns the bytes received.

    The bytes are written into a temporary ``entry.size``-byte sparse file beside
    ``path``; then its header must match ``entry`` (length and CRC32, as a load checks
    it) and every requested chunk its own block CRCs; only then is it renamed over
    ``path``. A refused or failed transfer leaves nothing under ``path`` (an existing
    file there is untouched) and no temporary file, and the sender raises too.

    Cost: blocking, point to point; writes the received bytes once and reads the
    chunks back once to verify them (page cache); memory: one piece of at most
    ``piece`` bytes (one CRC block if that is larger). Raises IntegrityError naming
    the file, the chunk and the peer when the header or a chunk fails its checks;
    CheckpointError when the sender failed or planned another transfer, a chunk is
    missing, or the file cannot be written here; CommunicationError when the link
    failed."""
    link = _Link(group, src, path)
    kind, _, payload = link.recv_ctl()
    if kind == _FAIL:
        link.raise_remote(payload, "sender")
    tmp, fd = None, -1
    try:
        try:
            ranges, cap = _check_head(payload, kind, path, entry, piece)
            tmp = os.path.join(os.path.dirname(path) or ".",
                               f".{os.path.basename(path)}.peer-{uuid.uuid4().hex[:12]}.tmp")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            os.ftruncate(fd, entry.size)  # holes where no range lands: no space used
        except Exception as e:
            raise _fail(link, _error(e, path, src)) from e
        link.send_ctl(_OK)  # go: the sender streams the ranges now
        buf = torch.empty(cap, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        local: BaseException | None = None
        for off, length in ranges:
            pos = off
            while pos < off + length:
                kind, n, payload = link.recv_ctl()
                if kind == _FAIL:
                    link.raise_remote(payload, "sender")
                if kind != _DATA or not 0 < n <= min(cap, off + length - pos):
                    raise _fail(link, CheckpointError(
                        f"peer transfer of ranges of {path}: rank {src} sent control "
                        f"({kind}, {n}) at byte {pos}, not a piece of at most {cap} bytes "
                        f"of range ({off}, {length}); the link is out of step"))
                link.recv(buf[:n])
                if local is None:  # after a local failure: drain the pieces, then say so
                    try:
                        _pwrite(fd, view[:n], pos)
                    except OSError as e:
                        local = e
                pos += n
        try:
            if local is not None:
                raise local
            _verify(fd, path, entry, chunks, ranges, cap)
            os.fsync(fd)
            os.replace(tmp, path)
            tmp = None
        except Exception as e:
            raise _fail(link, _error(e, path, src)) from e
        link.send_ctl(_OK)
        return sum(n for _, n in ranges)
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp is not None and fd >= 0:
            try:
                os.remove(tmp)
            except OSError:
                pass


def _error(e: BaseException, path: str, src: int) -> CheckpointError:
    """``e`` as the error both sides raise: IntegrityError stays one (damage)."""
    cls = IntegrityError if isinstance(e, IntegrityError) else CheckpointError
    msg = str(e) if isinstance(e, CheckpointError) else f"cannot write it here: {e!r}"
    return cls(f"peer transfer of ranges of {path} from rank {src}: {msg}")


def _fail(link: _Link, err: CheckpointError) -> CheckpointError:
    """Tell the sender (so it raises too) and return ``err`` for this side to raise."""
    link.fail(err)
    return err


def _pwrite(fd: int, data: memoryview, pos: int) -> None:
    while len(data):  # pwrite may write less than asked
        n = os.pwrite(fd, data, pos)
        data, pos = data[n:], pos + n


def _verify(fd: int, path: str, entry, chunks: list[Chunk], ranges: list, step: int) -> None:
    """Check the received header against ``entry`` (what a load checks) and every
    requested chunk against its block CRCs; a chunk must lie in a received range (a
    hole reads as zeros, which pass the CRC of a zero-filled chunk). Reads at most one
    CRC block or ``step`` bytes at a time. Raises IntegrityError / CheckpointError."""
    head = os.pread(fd, 8 + entry.header_len, 0)
    if _U64.unpack_from(head)[0] != entry.header_len or crc32(head) != entry.header_crc32:
        raise IntegrityError(f"shard file {path}: header checksum mismatch against the "
                             "manifest (corrupt, or another save's file)")
    tensors, block = shards.parse_header(head, path, entry.size)
    step = max(block, step // block * block)
    starts = [a for a, _ in ranges]
    for key, offsets in chunks:
        st = _find(tensors, path, key, offsets, chunks)
        i = bisect.bisect_right(starts, st.start) - 1
        if st.nbytes and (i < 0 or st.start + st.nbytes > sum(ranges[i])):
            raise CheckpointError(f"{_what(key, offsets)} of {path} was not sent (the "
                                  "ranks planned different transfers)")
        for pos in range(0, st.nbytes, step):
            data = os.pread(fd, min(step, st.nbytes - pos), st.start + pos)
            shards.verify(memoryview(data), pos // block, st.crcs, block,
                          f"shard file {path}, {_what(key, offsets)}")
