"""Read plans by rule (issue 47): for grid-stored tensors, ``reshard.plan_grid_reads``
(a binary search per dim on the cut points, only the overlapping cells built) must give
exactly the items ``reshard.plan_reads`` gives over every expanded chunk, in the same
order, for any saved grid and any wanted box. Property tests over random grids (long
dims kept as runs by the parse, uneven and empty cuts), grids saved by random meshes
and placements (Shard, Replicate, _StridedShard, 1-D and 2-D meshes), and targets of
another mesh (several boxes per rank), whole tensors and random boxes. Pure."""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dckpt.engine import reader
from dckpt.errors import ManifestError
from dckpt.format import manifest as mf
from dckpt.format import tiling
from dckpt.format.runs import Runs
from dckpt.layout import reshard, strided
from dckpt.layout.chunks import Box


def _n(k: int) -> int:
    return k * int(os.environ.get("DCKPT_TEST_EXAMPLES", "1"))


SETTINGS = settings(max_examples=_n(120), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _manifest(shape, grid, files, nfiles: int) -> bytes:
    """The JSON of a one-tensor manifest whose chunks are ``grid``'s cells in
    ``files``: parsed back, as a load sees it (long dims and file lists as runs)."""
    o, s = mf.grid_cells(grid)
    ft = [mf.FileEntry(f"data-0123456789abcdef-{r:05d}.safetensors", 4096, 64, 1, r)
          for r in range(nfiles)]
    t = mf.TensorEntry("w", "F32", tuple(shape), mf.Chunks(o, s, np.asarray(files, np.int64), grid))
    return mf.to_json(mf.Manifest("0123456789abcdef", nfiles, 0.0, ft, {"w": t}, {}))


def _check(data: bytes, wants: list[Box]) -> None:
    """Rule plans on a fresh parse (nothing expanded by them), then the expanded plans
    of the same manifest: equal, item by item."""
    c = mf.parse(data).tensors["w"].chunks
    assert c.grid is not None
    got = [reshard.plan_grid_reads(w, c.grid, c.file_of) for w in wants]
    # the rule path built no cells and expanded no runs (a small grid's cells are
    # built at parse time)
    if len(c) > mf._EAGER_CELLS:
        assert c._offsets is None
        assert all(b._expanded is None for b in (*c.grid, c.file_ids) if isinstance(b, Runs))
    for w, g in zip(wants, got):
        assert g == reshard.plan_reads(w, c.offsets, c.sizes, c.file), w
        for item in g:  # the box the reader looks the stored tensor up by
            assert c.box(item.chunk) == (tuple(c.offsets[item.chunk].tolist()),
                                         tuple(c.sizes[item.chunk].tolist()))


@st.composite
def cut_points(draw, extent_max: int = 400):
    """One dim's breakpoints: an even split (long: runs) with an uneven tail, or random
    cuts; sometimes one cell."""
    kind = draw(st.sampled_from(["even", "random", "one"]))
    if kind == "one":
        n = draw(st.integers(1, extent_max))
        return (0, n)
    if kind == "even":
        step, k = draw(st.integers(1, 7)), draw(st.integers(1, 30))
        tail = draw(st.integers(0, step - 1))
        pts = list(range(0, step * k + 1, step))
        return tuple(pts + ([pts[-1] + tail] if tail else []))
    cuts = draw(st.lists(st.integers(1, extent_max - 1), max_size=12, unique=True))
    return tuple([0, *sorted(cuts), extent_max])


@st.composite
def boxes_in(draw, shape):
    """A box inside ``shape``, empty sometimes."""
    lo = [draw(st.integers(0, n)) for n in shape]
    return Box(tuple(lo), tuple(draw(st.integers(0, n - a)) for a, n in zip(lo, shape)))


@SETTINGS
@given(st.lists(cut_points(), min_size=1, max_size=3), st.data())
def test_random_grids(grid, data):
    grid = tuple(grid)
    shape = tuple(b[-1] for b in grid)
    ncells = int(np.prod([len(b) - 1 for b in grid]))
    order = data.draw(st.sampled_from(["arange", "perm", "strided"]))
    if order == "arange":
        files = np.arange(ncells)
    elif order == "perm":
        files = np.random.default_rng(data.draw(st.integers(0, 99))).permutation(ncells)
    else:  # runs with a step: 0, 8, 16, ..., 1, 9, ...
        files = np.arange(ncells).reshape(-1, 1) if ncells % 4 else \
            np.arange(ncells).reshape(4, -1).T.ravel()
    wants = [Box((0,) * len(shape), shape)] + [data.draw(boxes_in(shape)) for _ in range(6)]
    _check(_manifest(shape, grid, np.asarray(files).ravel(), ncells), wants)


meshes = st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple)


@st.composite
def placements_for(draw, ndim: int, mesh_ndim: int):
    out = []
    for _ in range(mesh_ndim):
        kind = draw(st.sampled_from(["R", "S", "SS"]))
        d = draw(st.integers(0, ndim - 1))
        out.append(("R",) if kind == "R" else ("S", d) if kind == "S"
                   else ("SS", d, draw(st.integers(1, 4))))
    return tuple(out)


def _saved(shape, mesh, pl):
    """The grid and file per cell of a save of ``shape`` under ``mesh``/``pl`` (each
    distinct box written by the lowest rank holding it), or None when the boxes are not
    a grid."""
    boxes: dict = {}
    for r, coord in enumerate(itertools.product(*(range(m) for m in mesh))):
        lb = strided.local_boxes(shape, mesh, coord, pl)
        for o, z in zip(lb.offsets.tolist(), lb.sizes.tolist()):
            if np.prod(z):
                boxes.setdefault((tuple(o), tuple(z)), r)
    if not boxes:
        return None
    keys = list(boxes)
    t = tiling.analyse(shape, np.asarray([k[0] for k in keys], np.int64).reshape(len(keys), -1),
                       np.asarray([k[1] for k in keys], np.int64).reshape(len(keys), -1))
    if t.error or t.grid is None:
        return None
    return t.grid, np.asarray([boxes[keys[i]] for i in t.order.tolist()])


@SETTINGS
@given(st.lists(st.integers(0, 40), min_size=1, max_size=3).map(tuple), meshes, meshes,
       st.data())
def test_saved_and_target_meshes(shape, mesh, tmesh, data):
    """Saved by one mesh (uneven and empty shards, _StridedShard, 2-D), read by every
    rank of another (several boxes per rank under a strided target), by whole tensors
    and by random boxes."""
    got = _saved(shape, mesh, data.draw(placements_for(len(shape), len(mesh))))
    if got is None:
        return
    grid, files = got
    tpl = data.draw(placements_for(len(shape), len(tmesh)))
    wants = [Box((0,) * len(shape), shape), data.draw(boxes_in(shape))]
    for coord in itertools.product(*(range(m) for m in tmesh)):
        lb = strided.local_boxes(shape, tmesh, coord, tpl)
        wants += [Box(tuple(o), tuple(z)) for o, z in zip(lb.offsets.tolist(), lb.sizes.tolist())]
    _check(_manifest(shape, grid, files, int(np.prod(mesh))), wants)


def test_fsdp_at_scale_stays_runs():
    """A 4,096-rank FSDP grid with an uneven tail and empty last shards: a middle
    rank's box finds its one chunk and the neighbours it straddles, nothing expanded."""
    world, step = 4096, 3
    n = world * step - 700  # torch.chunk: the last ranks hold fewer rows, then none
    grid = (tuple(range(0, n, step)) + (n,), (0, 64))
    data = _manifest((n, 64), grid, np.arange(len(grid[0]) - 1), world)
    c = mf.parse(data).tensors["w"].chunks
    assert isinstance(c.grid[0], Runs) and isinstance(c.file_ids, Runs)
    _check(data, [Box((5000, 0), (7, 64)), Box((n - 2, 3), (2, 5)), Box((0, 0), (n, 64))])


def test_reader_uses_the_rule():
    """engine.reader.plan_reads takes the rule path for a grid-stored tensor."""
    from dckpt.state.tensors import LocalPiece
    import torch

    data = _manifest((4096, 4), (tuple(range(0, 4097, 4)), (0, 4)), np.arange(1024), 1024)
    e = mf.parse(data).tensors["w"]
    piece = LocalPiece("w", "F32", (4096, 4), Box((10, 0), (8, 4)), torch.empty(8, 4))
    items = reader.plan_reads(piece, e)
    assert [i.chunk for i in items] == [2, 3, 4] and e.chunks._offsets is None
    assert [i.file for i in items] == [2, 3, 4]


def test_runs_search_and_take():
    r = Runs([(0, 5, 10), (47, 3, 4), (60, 1, 1)])
    a = np.asarray(r)
    for x in range(-1, 63):
        for side in ("left", "right"):
            assert r.searchsorted(x, side) == np.searchsorted(a, x, side)
    assert r.take(np.array([0, 9, 10, 13, 14])).tolist() == a[[0, 9, 10, 13, 14]].tolist()
    assert (r.min(), r.max(), r.rising(), len(r)) == (0, 60, True, 15)


def test_hostile_grid_refused_before_allocation():
    """A grid of 10^12 cells in a few bytes of runs: refused at parse, nothing
    decoded (the per-dim and per-manifest caps are checked on the runs' counts)."""
    import json
    import tracemalloc

    ft = [["data-0123456789abcdef-00000.safetensors", 4096, 64, 1, 0]]
    doc = {"format": "dckpt", "version": 1, "save_id": "0123456789abcdef", "world_size": 1,
           "created": 0.0, "meta": {}, "values": {}, "files": ft,
           "tensors": {"w": {"dtype": "U8", "shape": [10 ** 6, 10 ** 6], "chunks": {
               "grid": [{"runs": [[0, 1, 10 ** 6 + 1]]}, {"runs": [[0, 1, 10 ** 6 + 1]]}],
               "file": {"runs": [[0, 0, 10 ** 12]]}}}}}
    tracemalloc.start()
    try:
        with pytest.raises(ManifestError, match="'w'"):
            mf.parse(json.dumps(doc).encode())
        assert tracemalloc.get_traced_memory()[1] < 50 << 20
    finally:
        tracemalloc.stop()


def _sealed(doc: dict) -> bytes:
    import json
    import zlib

    rest = json.dumps(doc, separators=(",", ":")).encode()[1:]
    return b'{"checksum":"crc32:%08x",' % zlib.crc32(rest) + rest


def _v4(tensor: dict) -> dict:
    """A version-4 manifest whose file table declares 4,194,304 files in a few bytes
    (so the per-file cap allows 2^28 chunks) holding one tensor entry."""
    n = 1 << 22
    col = {"runs": [[0, 1, n]]}
    return {"format": "dckpt", "version": 4, "save_id": "0123456789abcdef", "world_size": n,
            "created": 0.0, "meta": {}, "values": {}, "tensors": {"w": tensor},
            "files": {"names": "data", "rank": col, "size": {"runs": [[4096, 0, n]]},
                      "header_len": {"runs": [[64, 0, n]]}, "header_crc32": {"runs": [[1, 0, n]]}}}


def test_hostile_runs_under_a_large_file_table():
    """Runs kept as runs are bounded as decoded ones were: 10^12 cells refused; a grid
    over the per-dim extent refused; a grid at the caps parses without expanding."""
    import tracemalloc

    huge = {"dtype": "U8", "shape": [10 ** 6, 10 ** 6], "chunks": {
        "grid": [{"runs": [[0, 1, 10 ** 6 + 1]]}, {"runs": [[0, 1, 10 ** 6 + 1]]}],
        "file": {"runs": [[0, 1, 8]]}}}  # the grid's cell count is what refuses it
    over = {"dtype": "U8", "shape": [100], "chunks": {
        "grid": [{"runs": [[0, 1, 200]]}], "file": {"runs": [[0, 1, 199]]}}}
    wraps = {"dtype": "U8", "shape": [100], "chunks": {  # exact values leave int64
        "grid": [{"runs": [[0, 1 << 62, 9]]}], "file": {"runs": [[0, 1, 8]]}}}
    tracemalloc.start()
    try:
        for t, match in ((huge, "cells"), (over, "'w'"), (wraps, "'w'")):
            with pytest.raises(ManifestError, match=match):
                mf.parse(_sealed(_v4(t)))
        n = 1 << 20  # a million chunks as runs: parsed in O(runs)
        ok = {"dtype": "U8", "shape": [4 * n], "chunks": {
            "grid": [{"runs": [[0, 4, n + 1]]}], "file": {"runs": [[0, 1, n]]}}}
        c = mf.parse(_sealed(_v4(ok))).tensors["w"].chunks
        assert isinstance(c.grid[0], Runs) and isinstance(c.file_ids, Runs)
        assert c.box(n - 1) == ((4 * n - 4,), (4,)) and c.find((8,), (4,)).tolist() == [2]
        assert tracemalloc.get_traced_memory()[1] < 300 << 20  # the file table's 4 columns
    finally:
        tracemalloc.stop()


def test_a_mix_of_grid_and_irregular_tensors():
    """One load's pieces over a grid-stored tensor (by rule) and a chunk list (the
    scan): plan_pieces plans both, coverage checked, as the expanded plans say."""
    import torch

    from dckpt.state.tensors import LocalPiece

    ft = [mf.FileEntry(f"data-0123456789abcdef-{r:05d}.safetensors", 4096, 64, 1, r)
          for r in range(4)]
    go, gs = mf.grid_cells((tuple(range(0, 201, 2)), (0, 3)))
    grid = mf.TensorEntry("g", "F32", (200, 3), mf.Chunks(go, gs, np.arange(100) % 4,
                                                          (tuple(range(0, 201, 2)), (0, 3))))
    io = np.array([[0, 0], [0, 2], [1, 0], [1, 1], [1, 3]], np.int64)
    iz = np.array([[1, 2], [1, 2], [1, 1], [1, 2], [1, 1]], np.int64)
    irr = mf.TensorEntry("i", "F16", (2, 4), mf.Chunks(io, iz, np.array([0, 1, 2, 3, 0]), None))
    m = mf.parse(mf.to_json(mf.Manifest("0123456789abcdef", 4, 0.0, ft, {"g": grid, "i": irr}, {})))
    g, i = m.tensors["g"], m.tensors["i"]
    assert g.chunks.grid is not None and i.chunks.grid is None
    pieces = [(LocalPiece("g", "F32", (200, 3), Box((5, 1), (90, 2)), torch.empty(90, 2)), g),
              (LocalPiece("i", "F16", (2, 4), Box((0, 1), (2, 2)), torch.empty(2, 2)), i)]
    got = reader.plan_pieces(pieces)
    want = [(p, e, it) for p, e in pieces
            for it in reshard.plan_reads(p.box, e.chunks.offsets, e.chunks.sizes, e.chunks.file)]
    assert [(p.key, it) for p, _, it in got] == [(p.key, it) for p, _, it in want]
    assert len([1 for p, _, _ in got if p.key == "g"]) == 46
