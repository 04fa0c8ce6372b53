"""A manifest's block tables (``tensors[key].blocks``, docs/INCREMENTAL.md) are bounded
before any reader trusts them: the block size, and every field of an encoded chunk's
table (file, offset, length and codec of each block and of a delta's anchor), are
checked at parse against what the manifest itself states, and anything a reader could
not follow is a ManifestError naming the file, tensor, chunk and block. Pure: no torch,
no data files (the reads themselves: tests/test_encoded_reads.py)."""
from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dckpt.errors import ManifestError
from dckpt.format import codec
from dckpt.format import manifest as mf

WHERE = "ckpt/manifest.json"
I64 = (1 << 63) - 1
BLOCK = 4096
NBYTES = 3 * BLOCK + 100  # F32: 3,097 elements, 4 blocks, the last of 100 bytes
RAW = [BLOCK, BLOCK, BLOCK, 100]  # each block's raw bytes
HLEN = 100
ROOM = [20000, 9000]  # bytes after each file's header
NO_ANCHOR = [-1, -1, -1, -1]

# One row of each kind dckpt writes: raw, compressed, a sparse delta against a raw
# anchor in the base's file, a block referenced in the base's file (the last, partial).
ROWS = [[0, 0, BLOCK, codec.RAW] + NO_ANCHOR,
        [0, BLOCK, 1000, codec.ZSTD | codec.SHUFFLE] + NO_ANCHOR,
        [0, BLOCK + 1000, 500, codec.XOR | codec.SPARSE, 1, 0, BLOCK, codec.RAW],
        [1, 2 * BLOCK, 100, codec.RAW] + NO_ANCHOR]


def _examples(k: int) -> int:
    return k * int(os.environ.get("DCKPT_TEST_EXAMPLES", "1"))


def doc(rows=ROWS, size: int = BLOCK, dtype: str = "F32", nbytes: int = NBYTES) -> dict:
    """A version-3 manifest document: tensor "w" of ``nbytes`` in one chunk, encoded
    as ``rows`` in blocks of ``size``, in this checkpoint's file 0 and a sibling's file
    1 (each of ROOM bytes after its header)."""
    n = nbytes // mf.ITEMSIZE[dtype]
    files = (mf.FileEntry("data-00000000000000aa-00000.safetensors", 8 + HLEN + ROOM[0],
                          HLEN, 7, 0),
             mf.FileEntry("data-00000000000000bb-00000.safetensors", 8 + HLEN + ROOM[1],
                          HLEN, 8, 0, "s0"))
    o, s = mf.grid_cells(((0, n),))
    chunks = mf.Chunks(o, s, np.array([0]), ((0, n),))
    blocks = (mf.ChunkBlocks(BLOCK, bytes(16 * codec.nblocks(nbytes, BLOCK)),
                             np.array(ROWS, np.int64)),)
    m = mf.Manifest("00000000000000aa", 1, 1.0, files,
                    {"w": mf.TensorEntry("w", dtype, (n,), chunks, blocks)}, {})
    d = json.loads(mf.to_json(m))
    b = d["tensors"]["w"]["blocks"]
    b["size"] = size
    b["hash"] = base64.b64encode(bytes(16 * codec.nblocks(nbytes, size))).decode()
    b["enc"] = {"0": [x for col in zip(*rows) for x in col]} if rows is not None else {}
    return d


def parse(d: dict) -> mf.Manifest:
    return mf.parse(mf.seal(d), where=WHERE)


def refused(d: dict, *fragments: str) -> str:
    with pytest.raises(ManifestError) as e:
        parse(d)
    msg = str(e.value)
    for frag in (WHERE, "tensor 'w'") + fragments:
        assert frag in msg, (frag, msg)
    return msg


def with_field(i: int, col: int, value: int) -> list:
    rows = [list(r) for r in ROWS]
    rows[i][col] = value
    return rows


def test_the_tables_dckpt_writes_parse_unchanged():
    m = parse(doc())
    b = m.tensors["w"].blocks[0]
    assert b.size == BLOCK and b.table.tolist() == ROWS


# ------------------------------------------------------------------------ block size

@pytest.mark.parametrize("size", [4, 8, 12, 4096, codec.HASH_BLOCK])
def test_block_sizes_of_whole_elements_up_to_1_MiB_are_accepted(size):
    n = codec.nblocks(NBYTES, size)
    rows = [[0, k * size, min(size, NBYTES - k * size), codec.RAW] + NO_ANCHOR for k in range(n)]
    assert parse(doc(rows, size)).tensors["w"].blocks[0].size == size


@pytest.mark.parametrize("dtype,size", [("F32", 6), ("F32", 2), ("F32", 1), ("F64", 4),
                                        ("F64", 1020), ("BF16", 3), ("C64", 12)])
def test_a_block_size_that_cuts_an_element_is_refused(dtype, size):
    nbytes = 8 * 17
    n = codec.nblocks(nbytes, size)
    rows = [[0, k * size, min(size, nbytes - k * size), codec.RAW] + NO_ANCHOR for k in range(n)]
    refused(doc(rows, size, dtype, nbytes), f"block size {size} is not a multiple of its "
                                            f"item size {mf.ITEMSIZE[dtype]}")


@pytest.mark.parametrize("size", [0, -4, codec.HASH_BLOCK + 4, 2 * codec.HASH_BLOCK, 1 << 40,
                                  I64, 1 << 64, True, 4096.0, "4096", None])
def test_a_block_size_that_is_no_integer_in_1_to_1_MiB_is_refused(size):
    # over 1 MiB: a few KiB of compressed frame could decode to that much per block
    # before its hash is checked (it was accepted up to 1 TiB)
    d = doc(None)
    d["tensors"]["w"]["blocks"]["size"] = size
    refused(d, "block size")


def test_a_table_over_blocks_of_another_size_is_refused():
    # rows and hashes for 4 KiB blocks, the size saying 1 MiB: the counts disagree
    d = doc()
    d["tensors"]["w"]["blocks"]["size"] = codec.HASH_BLOCK
    refused(d, "block hashes for 1 blocks")


# ------------------------------------------------------------------- table fields

BAD_FIELDS = [
    # (block, column, value, why)
    (0, 0, -1, "file -1"), (0, 0, 2, "file 2"), (3, 0, I64, "a file past the table"),
    (0, 1, -1, "offset -1"), (1, 1, I64, "offset past any file"),
    (1, 1, ROOM[0] - 999, "bytes past the file's data"),
    (3, 1, ROOM[1] - 99, "a referenced block past its file's data"),
    (1, 1, I64 - 500, "offset + length overflowing int64"),
    (0, 2, -1, "length -1"), (0, 2, -(1 << 63), "length -2**63"),
    (0, 2, BLOCK - 1, "a raw block shorter than its bytes"),
    (0, 2, BLOCK + 1, "a raw block longer than its bytes"),
    (3, 2, BLOCK, "the partial last block stored as a whole one"),
    (1, 2, BLOCK + 1, "a compressed block larger than its raw bytes"),
    (1, 2, I64, "a compressed block of 2**63 bytes"),
    (2, 2, BLOCK + 1, "a delta larger than its raw bytes"),
    (0, 3, 32, "an unknown codec bit"), (0, 3, -1, "codec -1"),
    (0, 3, codec.SHUFFLE, "byte grouping without a compressor"),
    (0, 3, codec.XOR, "an XOR delta neither compressed nor sparse"),
    (0, 3, codec.SPARSE, "sparse words without XOR"),
    (0, 3, codec.ZSTD | codec.LZ4, "both compressors"),
    (2, 3, codec.XOR | codec.SPARSE | codec.ZSTD, "sparse and compressed"),
    (2, 4, -1, "a delta without its anchor's file"), (2, 4, 2, "anchor file 2"),
    (2, 5, -1, "anchor offset -1"), (2, 5, ROOM[1] - BLOCK + 1, "an anchor past its file"),
    (2, 6, BLOCK - 1, "a raw anchor shorter than the block"),
    (2, 6, -5, "anchor length -5"),
    (2, 7, codec.XOR | codec.SPARSE, "an anchor that is itself a delta"),
    (2, 7, codec.XOR | codec.ZSTD, "an anchor that is itself a compressed delta"),
    (2, 7, codec.SHUFFLE, "an anchor grouped without a compressor"),
    (2, 7, 64, "an anchor of unknown codec"),
]


@pytest.mark.parametrize("block,col,value,why", BAD_FIELDS, ids=[b[3] for b in BAD_FIELDS])
def test_a_table_field_a_reader_cannot_follow_is_refused_naming_the_block(block, col, value,
                                                                         why):
    refused(doc(with_field(block, col, value)), f"chunk 0 block {block}:",
            "anchor" if col >= 4 else "its block")


@pytest.mark.parametrize("col", [4, 5, 6, 7])
def test_a_block_that_is_not_a_delta_naming_an_anchor_is_refused(col):
    refused(doc(with_field(1, col, 0)), "chunk 0 block 1: a block that is not a delta "
                                        "names an anchor")


@pytest.mark.parametrize("flat,what", [([0] * 31, "block table of 31 numbers for 4 blocks"),
                                       ([0] * 33, "more than 32 values"),
                                       ({"runs": [[0, 0, 1 << 40]]}, "at most 32"),
                                       ("0", "expected a list"),
                                       ([0.5] * 32, "64-bit integers")])
def test_a_table_of_the_wrong_length_or_type_is_refused(flat, what):
    d = doc()
    d["tensors"]["w"]["blocks"]["enc"]["0"] = flat
    refused(d, what)


@pytest.mark.parametrize("name", ["1", "00", "+0", "-0", " 0", "0x0", "\u0660", "\u00b2",
                                  "9" * 5000])
def test_an_encoded_chunk_named_other_than_its_index_is_refused(name):
    d = doc()
    b = d["tensors"]["w"]["blocks"]
    b["enc"] = {name: b["enc"]["0"]}
    refused(d, "encoded chunk", "does not exist")


@pytest.mark.parametrize("flags", sorted(set(range(-1, 40)) - codec.CODECS))
def test_decode_refuses_every_codec_no_writer_produces(flags):
    with pytest.raises(ValueError, match="unknown codec"):
        codec.decode(flags, bytes(8), 8, 4, bytes(8))


# ------------------------------------------------------------- any table, against an oracle

def _followable(part: list, raw: int, codecs) -> bool:
    f, off, ln, fl = part
    return (0 <= f < len(ROOM) and fl in codecs and off >= 0 and 0 <= ln <= raw
            and off + ln <= ROOM[f] and (fl != codec.RAW or ln == raw))


def _oracle(rows: list) -> bool:
    """Whether a reader can follow every row: plain Python ints, no overflow."""
    for r, raw in zip(rows, RAW):
        if not _followable(r[:4], raw, codec.CODECS):
            return False
        if r[3] & codec.XOR:
            if not _followable(r[4:], raw, codec.ANCHOR_CODECS):
                return False
        elif r[4:] != NO_ANCHOR:
            return False
    return True


INTERESTING = st.sampled_from([-(1 << 63), -2, -1, 0, 1, 2, 99, 100, 101, 500, 1000,
                               BLOCK - 1, BLOCK, BLOCK + 1, ROOM[1] - BLOCK, ROOM[1] - 100,
                               ROOM[1], ROOM[0] - BLOCK, ROOM[0], I64 - BLOCK, I64]
                              + sorted(codec.CODECS) + [3, 4, 8, 16, 25, 32])
FIELD = st.one_of(INTERESTING, st.integers(-(1 << 63), I64))


@st.composite
def valid_row(draw, k: int) -> list:
    """A row dckpt could write for block ``k``: raw, compressed or a delta (against a
    raw or compressed anchor), in either file, anywhere its bytes fit."""
    raw = RAW[k]

    def stored(codecs) -> list:
        f = draw(st.integers(0, 1))
        fl = draw(st.sampled_from(sorted(codecs)))
        ln = raw if fl == codec.RAW else draw(st.integers(0, raw))
        return [f, draw(st.integers(0, ROOM[f] - ln)), ln, fl]

    block = stored(codec.CODECS)
    return block + (stored(codec.ANCHOR_CODECS) if block[3] & codec.XOR else NO_ANCHOR)


@st.composite
def tables(draw):
    """A table dckpt could write, then up to 3 of its fields replaced by interesting or
    arbitrary 64-bit integers."""
    rows = [draw(valid_row(k)) for k in range(len(RAW))]
    for _ in range(draw(st.integers(0, 3))):
        rows[draw(st.integers(0, 3))][draw(st.integers(0, 7))] = draw(FIELD)
    return rows


@settings(max_examples=_examples(400), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(tables())
def test_parse_accepts_exactly_the_tables_a_reader_can_follow(rows):
    d = doc(rows)
    event(f"followable: {_oracle(rows)}")
    if _oracle(rows):
        assert parse(d).tensors["w"].blocks[0].table.tolist() == rows
    else:
        refused(d, "chunk 0 block")
