"""Property tests of strided layouts (FSDP2 over TP): dckpt.layout.strided against torch's
own splitting code, and the planner and reshard math over several boxes per rank. Pure:
no process group (torch's placements split tensors without one)."""
from __future__ import annotations

import itertools
import os
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dckpt.errors import StateMismatchError
from dckpt.format import manifest as mf
from dckpt.layout import keymajor, localplan, plan, reshard, strided
from dckpt.format import tiling
from dckpt.layout.chunks import Box
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard


def _n(k: int) -> int:
    return k * int(os.environ.get("DCKPT_TEST_EXAMPLES", "1"))


SETTINGS = settings(max_examples=_n(150), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=_n(40), deadline=None,
               suppress_health_check=[HealthCheck.too_slow])

shapes = st.lists(st.integers(0, 13), min_size=1, max_size=3).map(tuple)
meshes = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


@st.composite
def placements_for(draw, ndim: int, mesh_ndim: int):
    """Replicate, Shard(d) or _StridedShard(d, sf) per mesh dim, any mix."""
    out = []
    for _ in range(mesh_ndim):
        kind = draw(st.sampled_from(["R", "S", "SS"]))
        if kind == "R":
            out.append(("R",))
            continue
        d = draw(st.integers(0, ndim - 1))
        out.append(("S", d) if kind == "S" else ("SS", d, draw(st.integers(1, 5))))
    return tuple(out)


@st.composite
def layouts(draw):
    shape, mesh = draw(shapes), draw(meshes)
    return shape, mesh, draw(placements_for(len(shape), len(mesh)))


def coords(mesh):
    return list(itertools.product(*(range(m) for m in mesh)))


def torch_placement(p):
    return Shard(p[1]) if p[0] == "S" else _StridedShard(p[1], split_factor=p[2])


def torch_local(x: torch.Tensor, mesh, coord, pl) -> torch.Tensor:
    """The local tensor DTensor gives the rank at ``coord``: torch's own placements
    split ``x`` left to right over the mesh dims (what distribute_tensor scatters)."""
    t = x
    for md, p in enumerate(pl):
        if p[0] != "R":
            t = torch_placement(p)._split_tensor(t, mesh[md], with_padding=False)[0][coord[md]]
    return t


def assemble(x: torch.Tensor, lb: strided.LocalBoxes) -> tuple[torch.Tensor, np.ndarray]:
    """The local tensor built from ``x`` by our boxes, and how often each local element
    was written."""
    out = torch.full(lb.local_shape, -1, dtype=x.dtype)
    count = np.zeros(lb.local_shape, np.int64)
    for box, region in zip(lb.boxes(), lb.regions()):
        if box.numel == 0:
            continue
        src = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
        out[region] = x[src]
        count[region] += 1
    return out, count


# ----------------------------------------------------------------------------- 1. boxes

@SETTINGS
@given(layouts())
def test_local_boxes_match_torch(layout):
    """Every rank's boxes, filled from the global tensor into their local regions, give
    exactly the local tensor torch's Shard/_StridedShard splitting gives; the regions
    cover the local tensor exactly once; local shape and first offset agree with
    torch's compute_local_shape_and_global_offset."""
    shape, mesh, pl = layout
    x = torch.arange(int(np.prod(shape)), dtype=torch.int64).reshape(shape)
    tpl = [torch_placement(p) if p[0] != "R" else __import__(
        "torch.distributed.tensor", fromlist=["Replicate"]).Replicate() for p in pl]
    for c in coords(mesh):
        want = torch_local(x, mesh, c, pl)
        lb = strided.local_boxes(shape, mesh, c, pl)
        assert lb.local_shape == tuple(want.shape), (c, lb.local_shape, want.shape)
        got, count = assemble(x, lb)
        assert torch.equal(got, want), (c, lb.offsets.tolist(), lb.sizes.tolist())
        if want.numel():
            assert (count == 1).all()
            tshape, toff = _compute_local_shape_and_global_offset(shape, mesh, list(c), tpl)
            assert tuple(tshape) == lb.local_shape
            assert tuple(toff) == tuple(lb.offsets[0].tolist())


@SETTINGS
@given(layouts())
def test_boxes_of_all_ranks_tile_the_tensor_once(layout):
    """The distinct non-empty boxes of all ranks cover every element exactly once;
    ranks that differ only along Replicate mesh dims hold the same boxes; a box of a
    rank never overlaps another of its own boxes."""
    shape, mesh, pl = layout
    seen: dict[tuple, tuple] = {}
    for c in coords(mesh):
        lb = strided.local_boxes(shape, mesh, c, pl)
        key = tuple(x for x, p in zip(c, pl) if p[0] != "R")
        boxes = [b for b in lb.boxes() if b.numel]
        assert len(set(boxes)) == len(boxes)
        if key in seen:
            assert seen[key] == tuple(boxes)
        seen[key] = tuple(boxes)
    distinct = [b for bs in seen.values() for b in bs]
    count = np.zeros(shape, np.int64)
    for b in distinct:
        count[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))] += 1
    assert (count == 1).all()
    if distinct:
        o = np.array([b.offsets for b in distinct], np.int64).reshape(len(distinct), len(shape))
        s = np.array([b.sizes for b in distinct], np.int64).reshape(len(distinct), len(shape))
        assert tiling.analyse(shape, o, s).error is None


@SETTINGS
@given(layouts())
def test_python_and_numpy_paths_agree(layout):
    """A few runs go through plain Python lists, many through numpy: both give the
    same boxes (forced here with the threshold at 0 and at a million)."""
    shape, mesh, pl = layout
    saved = strided._SMALL
    try:
        for c in coords(mesh):
            strided._SMALL = 0
            a = strided.local_boxes(shape, mesh, c, pl)
            strided._SMALL = 1 << 20
            b = strided.local_boxes(shape, mesh, c, pl)
            assert a.local_shape == b.local_shape
            for x, y in ((a.offsets, b.offsets), (a.sizes, b.sizes), (a.local, b.local)):
                assert x.dtype == y.dtype == np.int64 and np.array_equal(x, y)
    finally:
        strided._SMALL = saved


def test_fsdp2_over_tp_is_one_box_per_rank():
    """torch's docstring example: [8, 8] on a (dp=2, tp=2) mesh, [_StridedShard(0, sf=2),
    Shard(0)]: rank (dp, tp) holds rows 2 * (2 * tp + dp) ..., one box, the whole local
    tensor. S(0) then SS(0, sf=2) (a view's layout) interleaves: two boxes per rank."""
    pl = [("SS", 0, 2), ("S", 0)]
    got = {c: strided.local_boxes((8, 8), (2, 2), c, pl) for c in coords((2, 2))}
    assert {c: (b.offsets.tolist(), b.sizes.tolist()) for c, b in got.items()} == {
        (0, 0): ([[0, 0]], [[2, 8]]), (0, 1): ([[4, 0]], [[2, 8]]),
        (1, 0): ([[2, 0]], [[2, 8]]), (1, 1): ([[6, 0]], [[2, 8]])}
    lb = strided.local_boxes((8,), (2, 2), (0, 1), [("S", 0), ("SS", 0, 2)])
    assert lb.offsets.tolist() == [[1], [3]] and lb.local.tolist() == [[0], [1]]


def test_many_row_blocks_are_vectorised():
    """A 1-D _StridedShard with a split factor of 4,096 (4,096 row blocks per rank) is
    a few numpy passes: well under the time of a Python loop over the blocks."""
    t = time.perf_counter()
    lb = strided.local_boxes((4096 * 4 * 3, 128), (4,), (2,), [("SS", 0, 4096)])
    elapsed = time.perf_counter() - t
    assert len(lb) == 4096 and lb.local_shape == (4096 * 3, 128)
    assert (lb.sizes[:, 0] == 3).all() and (np.diff(lb.offsets[:, 0]) == 12).all()
    assert elapsed < 0.05, elapsed


def test_bad_placements_raise():
    with pytest.raises(ValueError, match="split factor"):
        strided.local_boxes((4,), (2,), (0,), [("SS", 0, 0)])
    with pytest.raises(ValueError, match="Shard"):
        strided.local_boxes((4,), (2,), (0,), [("SS", 1, 2)])
    with pytest.raises(ValueError, match="not Shard"):
        strided.local_boxes((4,), (2,), (0,), [("P",)])


# ----------------------------------------------------------------------------- 2. planning

def local_plans(mesh, keys) -> list[localplan.LocalPlan]:
    """Every rank's plan: one item per box (a key repeated for a strided tensor), as
    dckpt.protocol.commit.local_plan builds it."""
    out = []
    for c in coords(mesh):
        items, flat = [], []
        for key, dt, shape, pl in keys:
            lb = strided.local_boxes(shape, mesh, c, pl)
            for o, s in zip(lb.offsets.tolist(), lb.sizes.tolist()):
                items.append((key, dt, shape))
                flat += o + s
        out.append(localplan.LocalPlan(items, np.array(flat, np.int64)))
    return out


@st.composite
def states(draw):
    mesh = draw(meshes)
    keys = []
    for k in range(draw(st.integers(1, 4))):
        shape = draw(shapes)
        keys.append((f"k{k}", draw(st.sampled_from(["F32", "BF16", "I8"])), shape,
                     draw(placements_for(len(shape), len(mesh)))))
    return mesh, keys


@SETTINGS
@given(states())
def test_plan_global_writes_every_box_once(state):
    """The coordinator accepts several boxes per rank and key: every distinct box is
    written once, by a rank that holds it; the manifest (grid or list form) parses
    back to the same chunks; the key-major fast path and the general sorted path give
    the same rows."""
    mesh, keys = state
    plans = local_plans(mesh, keys)
    cache: dict = {}
    plans = [localplan.decode(localplan.encode(p), cache) for p in plans]
    gp = plan.plan_global(plans)
    written: dict[tuple, int] = {}
    for r, (p, w) in enumerate(zip(plans, gp.writes)):
        pos = 0
        for (key, _, shape), wi in zip(p.items, w):
            nd = len(shape)
            box = (key, tuple(p.boxes[pos:pos + nd].tolist()), tuple(p.boxes[pos + nd:pos + 2 * nd].tolist()))
            pos += 2 * nd
            if wi:
                assert box not in written, box
                written[box] = r
    for key, _, shape, _ in keys:
        t = gp.tensors[key]
        got = {(key, tuple(o), tuple(s)) for o, s in zip(t.offsets.tolist(), t.sizes.tolist())}
        assert got == {b for b in written if b[0] == key}
        count = np.zeros(shape, np.int64)
        for o, s in zip(t.offsets.tolist(), t.sizes.tolist()):
            count[tuple(slice(a, a + b) for a, b in zip(o, s))] += 1
        assert (count == 1).all()
    files = [mf.FileEntry(f"data-0123456789abcdef-{r}.safetensors", 100, 8, 0, r)
             for r in range(len(plans))]
    m = plan.to_manifest(gp, files, "0123456789abcdef", len(plans))
    back = mf.parse(mf.to_json(m))
    for key in gp.tensors:
        assert (back.tensors[key].chunks.offsets == gp.tensors[key].offsets).all()
    # key-major (with its per-key sort) and the general lexsort agree
    names, meta, table_ids = plan._key_table(plans)
    shp, nd = plan.shape_table(meta)
    fast = keymajor.rows(plans, table_ids, shp, nd)
    if fast is not None:
        slow = plan._sorted_rows(plans, meta, table_ids, names, shp)
        for a, b in zip((fast.kid, fast.rank, fast.local, fast.new, *fast.offs, *fast.sizes),
                        (slow.kid, slow.rank, slow.local, slow.new, *slow.offs, *slow.sizes)):
            assert np.array_equal(a, b)


def test_fsdp2_tp_plans_take_the_key_major_path():
    """(dp=8, tp=4) FSDP2 over TP: the boxes do not ascend with the rank, yet the
    planner stays on its sort-free key-major path (one table, a per-key sort)."""
    mesh = (8, 4)
    keys = [("col", "BF16", (64, 16), (("SS", 0, 4), ("S", 0))),
            ("row", "BF16", (16, 64), (("S", 0), ("S", 1))),
            ("norm", "F32", (16,), (("S", 0), ("R",)))]
    plans = local_plans(mesh, keys)
    names, meta, table_ids = plan._key_table(plans)
    nd = np.array([len(s) for _, s, _ in meta], np.int64)
    shp = np.ones((len(meta), 2), np.int64)
    for i, (_, s, _) in enumerate(meta):
        shp[i, :len(s)] = s
    rows = keymajor.rows(plans, table_ids, shp, nd)
    assert rows is not None
    gp = plan.plan_global(plans)
    col = gp.tensors["col"]
    assert col.offsets[:, 0].tolist() == list(range(0, 64, 2))
    # block b of the rows is held by rank (dp, tp) with b = tp * 8 + dp
    assert col.writer.tolist() == [(b % 8) * 4 + b // 8 for b in range(32)]
    assert gp.tensors["row"].grid == ((0, 2, 4, 6, 8, 10, 12, 14, 16), (0, 16, 32, 48, 64))


def test_a_box_listed_twice_by_one_rank_is_refused():
    a = localplan.LocalPlan([("w", "F32", (4,)), ("w", "F32", (4,))], np.array([0, 2, 0, 2]))
    b = localplan.LocalPlan([("w", "F32", (4,))], np.array([2, 2]))
    with pytest.raises(StateMismatchError, match="rank 0 lists the box .* 'w' twice"):
        plan.plan_global([a, b])
    # two different boxes of one key on one rank are a strided layout: accepted
    a = localplan.LocalPlan([("w", "F32", (4,)), ("w", "F32", (4,))], np.array([0, 1, 2, 1]))
    b = localplan.LocalPlan([("w", "F32", (4,)), ("w", "F32", (4,))], np.array([1, 1, 3, 1]))
    gp = plan.plan_global([a, b])
    assert gp.tensors["w"].writer.tolist() == [0, 1, 0, 1]


# ----------------------------------------------------------------------------- 3. reshard

@FEW
@given(layouts(), st.data())
def test_reshard_between_strided_layouts(saved, data):
    """A tensor saved under one layout (strided or not) and read into another on a
    different mesh: every target box is covered exactly once by the reads planned for
    it, and the copies rebuild exactly torch's local tensor of the target."""
    shape, mesh, pl = saved
    tmesh = data.draw(meshes)
    tpl = data.draw(placements_for(len(shape), len(tmesh)))
    x = torch.arange(int(np.prod(shape)), dtype=torch.int64).reshape(shape)
    boxes = {}
    for c in coords(mesh):
        for b in strided.local_boxes(shape, mesh, c, pl).boxes():
            if b.numel:
                boxes[b] = True
    chunks = list(boxes)
    offs = np.array([b.offsets for b in chunks], np.int64).reshape(len(chunks), len(shape))
    sizes = np.array([b.sizes for b in chunks], np.int64).reshape(len(chunks), len(shape))
    files = np.arange(len(chunks), dtype=np.int64)
    stored = [x[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))] for b in chunks]
    for c in coords(tmesh):
        lb = strided.local_boxes(shape, tmesh, c, tpl)
        out = torch.full(lb.local_shape, -1, dtype=torch.int64)
        for box, region in zip(lb.boxes(), lb.regions()):
            dest = out[region]
            covered = 0
            for item in reshard.plan_reads(box, offs, sizes, files):
                dest[item.dst] = stored[item.chunk][item.src]
                covered += int(np.prod([s.stop - s.start for s in item.dst]))
            assert covered == box.numel
        assert torch.equal(out, torch_local(x, tmesh, c, tpl))


@SETTINGS
@given(st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=4), min_size=2, max_size=3),
       st.data())
def test_c_order_grids_are_recognised_without_a_sort(steps, data):
    """Boxes that are a grid's cells in C order (the planner's order for rowwise
    weights under FSDP2 over TP) take the sort-free path and give the same grid as
    the general test on the same boxes shuffled; a perturbed box is never accepted as
    a grid by the fast path."""
    bps = [np.concatenate(([0], np.cumsum(s))) for s in steps]
    shape = tuple(int(b[-1]) for b in bps)
    cells = list(itertools.product(*[range(len(s)) for s in steps]))
    offs = np.array([[bps[d][i] for d, i in enumerate(c)] for c in cells], np.int64)
    sizes = np.array([[steps[d][i] for d, i in enumerate(c)] for c in cells], np.int64)
    fast = tiling._c_order_grid(shape, offs, sizes)
    cut = [d for d in range(len(shape)) if len(steps[d]) > 1]
    if len(cut) >= 2:
        assert fast is not None and fast.order.tolist() == list(range(len(cells)))
    got = tiling.analyse(shape, offs, sizes)
    perm = np.random.default_rng(len(cells)).permutation(len(cells))
    slow = tiling.analyse(shape, offs[perm], sizes[perm])
    assert got.error is None and slow.error is None and got.grid == slow.grid
    assert tuple(tuple(b.tolist()) for b in bps) == got.grid
    # move one box's offset: never a grid through the fast path
    i = data.draw(st.integers(0, len(cells) - 1))
    d = data.draw(st.integers(0, len(shape) - 1))
    bad = offs.copy()
    bad[i, d] += data.draw(st.sampled_from([-1, 1]))
    if (bad >= 0).all() and (bad + sizes <= np.array(shape)).all():
        f = tiling._c_order_grid(shape, bad, sizes)
        assert f is None
        assert tiling.analyse(shape, bad, sizes).error is not None


def test_chunk_names_in_a_file():
    """A key's only chunk in a file is named by the key; several are key@offsets, and
    so is every chunk of a key holding '@' (no name stands for two chunks); lookups try
    the key (a file's only chunk, files of older saves) and then the offset name."""
    from dckpt.format.chunknames import find_stored, stored_names
    from dckpt.state.tensors import LocalPiece

    def piece(key, offs):
        return LocalPiece(key, "F32", (8, 4), Box(offs, (2, 4)), None)

    names = stored_names([piece("w", (0, 0)), piece("b", (0, 0)), piece("w", (4, 0))])
    assert names == ["w@0,0", "b", "w@4,0"]
    # a key holding '@' is always stored with its offsets: it can never spell another
    # key's box name (w's box at (4, 0) and the key "w@4,0" stay apart)
    assert stored_names([piece("w", (0, 0)), piece("w", (4, 0)), piece("w@4,0", (0, 0))]) \
        == ["w@0,0", "w@4,0", "w@4,0@0,0"]
    header = {"w@0,0": "first", "w@4,0": "second", "b": "bias"}
    assert find_stored(header, "w", (4, 0)) == "second"
    assert find_stored(header, "b", (0, 0)) == "bias"
    assert find_stored({"w": "only"}, "w", (4, 0)) == "only"
    assert find_stored(header, "x", (0, 0)) is None
    # a key's only chunk is found by its key even beside a key that looks like a box
    assert stored_names([piece("w", (0, 0)), piece("w@0,0", (0, 0))]) == ["w", "w@0,0@0,0"]
    assert find_stored({"w": "mine", "w@0,0": "other"}, "w", (0, 0)) == "mine"
    assert stored_names([piece("a@0,0", (0, 0)), piece("a@0,0", (4, 0)),
                         piece("a", (0, 0)), piece("a", (4, 0))]) \
        == ["a@0,0@0,0", "a@0,0@4,0", "a@0,0", "a@4,0"]


def test_key_that_looks_like_a_box_name_loads_its_own_values(tmp_path):
    """Keys ``w`` and ``w@0`` in one file: each loads its own values (the box-name
    lookup once returned ``w@0``'s chunk for ``w``)."""
    import dckpt

    path = str(tmp_path / "ck")
    dckpt.save({"w": torch.zeros(4), "w@0": torch.ones(4)}, path)
    got = {"w": torch.full((4,), 7.0), "w@0": torch.full((4,), 7.0)}
    dckpt.load(got, path)
    assert torch.equal(got["w"], torch.zeros(4))
    assert torch.equal(got["w@0"], torch.ones(4))
