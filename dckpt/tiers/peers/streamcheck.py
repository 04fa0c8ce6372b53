"""Checking a shard file against its own header's CRCs as its bytes arrive, in order: the
checks :func:`dckpt.tiers.peers.xfer.verify_shard` makes, without reading the file back
(a peer transfer's receiver feeds each piece as it writes it). Pure: no I/O."""
from __future__ import annotations

import struct

from ...errors import CheckpointError, IntegrityError
from ...format import shards
from ...format.checksum import crc32

_U64 = struct.Struct("<Q")


class StreamCheck:
    """What :func:`verify_shard` checks, on the bytes of a shard file as they arrive in
    order (no read-back): its header parsed from the first bytes, tensors that tile the
    data region exactly, and every block of every tensor against its CRC32. Feed every
    byte once, in order; :meth:`finish` after the last. CPU: one CRC pass; memory: the
    header. Raises IntegrityError naming ``path`` and what failed."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        self.head = bytearray()
        self.spans: list | None = None  # the tensors by start, once the header is in
        self.block = 0
        self.i = self.b = self.filled = self.crc = 0  # tensor, block, bytes, CRC so far

    def _header(self) -> None:
        if len(self.head) >= 8 and self.spans is None:
            (hlen,) = _U64.unpack(bytes(self.head[:8]))
            if hlen > min(shards.MAX_HEADER, self.size - 8):
                raise IntegrityError(f"shard file {self.path}: header length {hlen} does not "
                                     f"fit the file ({self.size} bytes)")
            if len(self.head) >= 8 + hlen:
                try:
                    tensors, self.block = shards.parse_header(bytes(self.head[:8 + hlen]),
                                                              self.path, self.size)
                except IntegrityError:
                    raise
                except CheckpointError as e:
                    raise IntegrityError(str(e)) from None
                self.spans = sorted(tensors.values(), key=lambda st: st.start)
                end = 8 + hlen
                for st in self.spans:
                    if st.start != end:
                        raise IntegrityError(f"shard file {self.path}: bytes {end}.."
                                             f"{st.start - 1} are not described by its header")
                    end += st.nbytes
                if end != self.size:
                    raise IntegrityError(f"shard file {self.path}: bytes {end}..{self.size - 1}"
                                         " are not described by its header")
                self.spans = [st for st in self.spans if st.nbytes]

    def feed(self, data: memoryview, pos: int) -> None:
        """Bytes ``[pos, pos + len(data))`` of the file (every byte once, in order)."""
        if self.spans is None:
            # keep only the header's bytes: its length first (checked), then the header
            i = 0
            while self.spans is None and i < len(data):
                want = 8 if len(self.head) < 8 else self._data_start()
                n = min(want - len(self.head), len(data) - i)
                self.head += data[i:i + n]
                i += n
                self._header()
            if self.spans is None:
                return
            data, pos = data[i:], pos + i
        while len(data):
            st = self.spans[self.i]
            n = min(self.block - self.filled, st.start + st.nbytes - pos, len(data))
            self.crc = crc32(data[:n], self.crc)
            self.filled += n
            data, pos = data[n:], pos + n
            if self.filled == self.block or pos == st.start + st.nbytes:
                shards.check_block(self.crc, self.b, st.crcs,
                                    f"shard file {self.path}, tensor {st.name!r}")
                self.b, self.crc, self.filled = self.b + 1, 0, 0
                if pos == st.start + st.nbytes:
                    self.i, self.b = self.i + 1, 0

    def _data_start(self) -> int:
        return 8 + _U64.unpack(bytes(self.head[:8]))[0]

    def finish(self) -> None:
        """Raise IntegrityError unless every byte was checked."""
        if self.spans is None:
            raise IntegrityError(f"shard file {self.path}: {self.size} bytes, shorter than "
                                 "its header")
        if self.i != len(self.spans):
            raise IntegrityError(f"shard file {self.path}: ended inside tensor "
                                 f"{self.spans[self.i].name!r}")
