"""FSDP2 over tensor parallelism (torchtitan's layout): a small transformer block with
its Adam state saved as a dckpt.TrainingState from a (dp=2, tp=2) mesh, an HSDP + TP
(2, 2, 2) mesh, TP only, FSDP2 only and FSDP1, restored into each of the others at other
world sizes and into one process with plain tensors, bitwise equal; strided DTensors of
several boxes per rank saved and loaded into; each rank reads only the byte ranges it
needs."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

D, HIDDEN, VOCAB = 12, 22, 30  # 22 and 30 split unevenly under FSDP2 over TP


class Block(torch.nn.Module):
    """Embedding, a gated attention-like mixer and a SwiGLU MLP, each with a norm."""

    def __init__(self) -> None:
        super().__init__()
        L = torch.nn.Linear
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.norm1, self.norm2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.wq, self.wv, self.wo = L(D, D, bias=False), L(D, D, bias=False), L(D, D, bias=False)
        self.w1, self.w3, self.w2 = L(D, HIDDEN, bias=False), L(D, HIDDEN, bias=False), \
            L(HIDDEN, D, bias=False)
        self.out = L(D, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        x = self.norm1(h)
        h = h + self.wo(torch.nn.functional.silu(self.wq(x)) * self.wv(x))
        x = self.norm2(h)
        h = h + self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))
        return self.out(h)


def _tp_plan():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel(), RowwiseParallel()
    return {"emb": RowwiseParallel(input_layouts=Replicate()), "wq": col, "wv": col,
            "wo": row, "w1": col, "w3": col, "w2": row,
            "out": ColwiseParallel(output_layouts=Replicate())}


def _build(layout: str, seed: int = 0):
    """The block parallelised as ``layout`` over every rank of the default group, and
    its Adam. ``fsdp2_tp``: (dp=world/2, tp=2); ``hsdp_tp``: (replicate=2, shard=2,
    tp=2); ``tp``; ``fsdp2``; ``fsdp1``; ``plain`` (no parallelism)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(seed)
    model = Block()
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp = dp = None
    if layout == "fsdp2_tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tp, dp = mesh["tp"], mesh["dp"]
    elif layout == "hsdp_tp":
        mesh = init_device_mesh("cpu", (2, world // 4, 2), mesh_dim_names=("rep", "shard", "tp"))
        tp, dp = mesh["tp"], mesh["rep", "shard"]
    elif layout == "tp":
        tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    elif layout == "fsdp2":
        dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    if tp is not None:
        parallelize_module(model, tp, _tp_plan())
    if dp is not None:  # torchtitan: each block, then the root
        for name in ("wq", "wv", "wo", "w1", "w3", "w2"):
            fully_shard(getattr(model, name), mesh=dp)
        fully_shard(model, mesh=dp)
    if layout == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def _step(model, opt) -> None:
    ids = torch.arange(8).reshape(2, 4) * 3 % VOCAB  # the same batch on every rank
    opt.zero_grad()
    model(ids).float().pow(2).mean().backward()
    opt.step()


def _full(model, opt) -> dict:
    """Every parameter and optimizer value as one full tensor (torch's full_tensor()
    / all-gather), by FQN."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, flatten_optimizer_state_dict=True))
    out = {f"model.{k}": v for k, v in msd.items()}
    out.update({f"optim.{k}": v for k, v in osd.items()})
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def _placements(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: str(tuple(p.placements)) for k, p in model.named_parameters()
            if isinstance(p, DTensor)}


def _save(path: str, layout: str) -> tuple[dict, dict]:
    import dckpt

    model, opt = _build(layout)
    _step(model, opt)
    dckpt.save({"train": dckpt.TrainingState(model, opt), "step": 1}, path)
    return _full(model, opt), _placements(model)


def _load(path: str, layout: str) -> dict:
    import dckpt

    model, opt = _build(layout, seed=7)  # other values: the load must replace them all
    state = {"train": dckpt.TrainingState(model, opt), "step": 0}
    dckpt.load(state, path)
    assert state["step"] == 1
    return _full(model, opt)


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            # bitwise: the raw bytes, not a float comparison (NaN-safe, -0.0-exact)
            assert torch.equal(got[k].reshape(-1).view(torch.uint8),
                               v.reshape(-1).view(torch.uint8)), k
        else:
            assert got[k] == v, k


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    """The (dp=2, tp=2) checkpoint, its full values, and the HSDP + TP (2, 2, 2) one."""
    root = tmp_path_factory.mktemp("fsdp_tp")
    p4, p8 = str(root / "fsdp2_tp"), str(root / "hsdp_tp")
    out4 = ranks(4).run(_save, p4, "fsdp2_tp")
    out8 = ranks(8).run(_save, p8, "hsdp_tp")
    return {"fsdp2_tp": (p4, out4[0][0], out4[0][1]), "hsdp_tp": (p8, out8[0][0], out8[0][1])}


def test_layouts_are_strided(saved):
    """What is being tested: FSDP2 over TP puts a _StridedShard on the dp mesh dim of
    every colwise weight; HSDP adds a Replicate in front."""
    placements = saved["fsdp2_tp"][2]
    assert "_StridedShard(dim=0, sf=2)" in placements["wq.weight"]
    assert "Shard(dim=1)" in placements["wo.weight"]
    assert placements["emb.weight"].count("_StridedShard") == 1
    assert "Replicate()" in saved["hsdp_tp"][2]["w1.weight"]
    assert "_StridedShard(dim=0, sf=2)" in saved["hsdp_tp"][2]["w1.weight"]


@pytest.mark.parametrize("src, world, layout", [
    ("fsdp2_tp", 4, "fsdp2_tp"),  # same layout
    ("fsdp2_tp", 2, "tp"),  # 4 -> 2, TP only
    ("fsdp2_tp", 3, "fsdp2"),  # 4 -> 3, FSDP2 only
    ("fsdp2_tp", 2, "fsdp1"),  # 4 -> 2, FSDP1 (ShardedTensor)
    ("fsdp2_tp", 8, "hsdp_tp"),  # 4 -> 8, (2, 2, 2)
    ("hsdp_tp", 4, "fsdp2_tp"),  # 8 -> 4
    ("hsdp_tp", 4, "tp"),  # 8 -> 4, TP only
])
def test_restore_into_other_layouts(ranks, saved, src, world, layout):
    path, want, _ = saved[src]
    for got in ranks(world).run(_load, path, layout):
        _same(got, want)


def test_restore_into_one_process_with_plain_tensors(saved):
    """No process group: plain full tensors, the optimizer state as saved."""
    import dckpt

    path, want, _ = saved["fsdp2_tp"]
    target = {"train": {"model": {}, "optim": {}}, "step": 0}
    def blank(v):  # the same structure, other values
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        return type(v)(blank(x) for x in v) if isinstance(v, (tuple, list)) else None

    for k, v in want.items():
        part, _, rest = k.partition(".")
        target["train"][part][rest] = blank(v)
    dckpt.load(target, path)
    got = {f"{part}.{k}": v for part in ("model", "optim") for k, v in target["train"][part].items()}
    _same(got, want)
    assert target["step"] == 1


def _save_from(path: str, layout: str) -> dict:
    """Train one step under ``layout`` and save (the other direction of a round trip)."""
    return _save(path, layout)[0]


@pytest.mark.parametrize("world, src, back_world", [(2, "tp", 4), (3, "fsdp2", 4), (2, "fsdp1", 8)])
def test_other_layouts_restore_into_fsdp2_tp(ranks, tmp_path, world, src, back_world):
    """TP only (2 ranks) -> FSDP2 + TP (4), FSDP2 (3) -> (2, 2), FSDP1 (2) -> (2, 2, 2)."""
    path = str(tmp_path / src)
    want = ranks(world).run(_save_from, path, src)[0]
    layout = "hsdp_tp" if back_world == 8 else "fsdp2_tp"
    for got in ranks(back_world).run(_load, path, layout):
        _same(got, want)


# ------------------------------------------------------- strided DTensors, bytes read

ROWS, COLS = 2048, 256  # F32: 1 KiB rows; a (2, 2) mesh's boxes are 512 KiB, 2 CRC blocks


def _big() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.5 - 7


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


def _strided(kind: str, zero: bool):
    """The big tensor as a DTensor. ``fsdp_tp``: [_StridedShard(0, sf=2), Shard(0)]
    on (2, 2), one box per rank; ``views``: [Shard(0), _StridedShard(0, sf=2)] on
    (2, 2), two interleaved boxes per rank; ``rows``: Shard(0) over every rank;
    ``cols``: Shard(1) over every rank."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    world = dist.get_world_size()
    t = torch.zeros(ROWS, COLS) if zero else _big()
    if kind == "fsdp_tp":
        return distribute_tensor(t, _mesh((2, world // 2)), [_StridedShard(0, split_factor=2), Shard(0)])
    if kind == "views":
        return distribute_tensor(t, _mesh((2, world // 2)), [Shard(0), _StridedShard(0, split_factor=2)])
    return distribute_tensor(t, _mesh((world,)), [Shard(0 if kind == "rows" else 1)])


def _save_big(path: str, kind: str) -> None:
    import dckpt

    dckpt.save({"big": _strided(kind, zero=False)}, path)


def _load_big(path: str, kind: str) -> tuple[int, int, list]:
    """Load into ``kind``; returns (bytes read, the bytes this rank needs, its boxes)
    after checking its local values against torch's own split of the full tensor."""
    import dckpt
    from dckpt.engine import reader
    from dckpt.state.tensors import describe_all

    target = {"big": _strided(kind, zero=True)}
    reads = []
    orig = reader._Files.read_exact

    def spy(self, path, start, bufs, what):
        reads.append(sum(memoryview(b).nbytes for b in bufs))
        return orig(self, path, start, bufs, what)

    reader._Files.read_exact = spy
    try:
        dckpt.load(target, path)
    finally:
        reader._Files.read_exact = orig
    want = _strided(kind, zero=False).to_local()
    assert torch.equal(target["big"].to_local(), want)
    assert torch.equal(target["big"].full_tensor(), _big())
    boxes = [(p.box.offsets, p.box.sizes) for p in describe_all("big", target["big"])]
    return sum(reads), want.numel() * 4, boxes


def _expected_read(saved_rows: list[tuple[int, int]], boxes: list, block: int = 256 << 10) -> int:
    """Bytes a rank must read for its boxes from row chunks ``saved_rows`` (start,
    stop; whole rows): per overlapping chunk, the span from the first element it needs
    to the last, widened to whole checksum blocks of that chunk."""
    total = 0
    for (r0, q0), (nr, nq) in boxes:
        for c0, c1 in saved_rows:
            lo, hi = max(r0, c0), min(r0 + nr, c1)
            if hi <= lo:
                continue
            a = ((lo - c0) * COLS + q0) * 4
            b = ((hi - 1 - c0) * COLS + q0 + nq) * 4
            total += min(-(-b // block) * block, (c1 - c0) * COLS * 4) - a // block * block
    return total


@pytest.mark.parametrize("src, world, dst", [("fsdp_tp", 3, "rows"), ("rows", 4, "views"),
                                             ("views", 4, "fsdp_tp"), ("fsdp_tp", 4, "cols")])
def test_strided_tensors_read_only_what_each_rank_needs(ranks, tmp_path, src, world, dst):
    """A strided DTensor saved from 4 ranks (or a row-sharded one into a strided
    target): every rank's values are torch's, and it reads exactly the checksum blocks
    that hold elements of its boxes: for row boxes a fraction of the checkpoint."""
    path = str(tmp_path / "big")
    ranks(4).run(_save_big, path, src)
    from dckpt.format import manifest as mf
    from dckpt.storage.fsspec_storage import make_storage

    storage, root = make_storage(path, None)
    m = mf.parse(storage.read(storage.join(root, mf.MANIFEST_NAME), 0,
                              storage.size(storage.join(root, mf.MANIFEST_NAME))))
    c = m.tensors["big"].chunks
    saved_rows = sorted((int(o[0]), int(o[0] + s[0])) for o, s in zip(c.offsets, c.sizes))
    total = ROWS * COLS * 4
    for got, need, boxes in ranks(world).run(_load_big, path, dst):
        assert got == _expected_read(saved_rows, boxes), (got, boxes)
        # a column quarter of every 1 KiB row touches every checksum block: all of it
        assert need <= got < total if dst != "cols" else got == total



def _write_state(add: float, zero: bool = False) -> dict:
    """Two boxes per rank per tensor: ``big`` as [Shard(0), _StridedShard(0, sf=2)] on
    (2, 2); ``rep`` as [Replicate(), _StridedShard(0, sf=2)] on (2, 2) (each box held
    by two ranks: one writes it, the fast tier keeps the other as a replica)."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    big = _strided("views", zero)
    if not zero:
        big = big + add
    full = torch.zeros(10, 3) if zero else torch.arange(30.0).reshape(10, 3) + add
    rep = distribute_tensor(full, _mesh((2, 2)), [Replicate(), _StridedShard(0, split_factor=2)],
                            src_data_rank=None)  # uneven: split locally, no scatter
    return {"big": big, "rep": rep, "step": int(add)}


def _same_state(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].to_local(), b[k].to_local()) for k in ("big", "rep")) \
        and a["step"] == b["step"]


def _write_paths(base: str) -> list:
    """Compressed, incremental, async and fast-tier saves of several boxes per rank,
    each loaded back; the CLI's verify passes on each durable checkpoint."""
    import os

    import dckpt
    from dckpt.catalog.verify import verify_checkpoint

    out = []
    for name, kw, add in (("zstd", dict(compression="zstd"), 1.0),
                          ("incr", dict(base=os.path.join(base, "zstd")), 2.0)):
        path = os.path.join(base, name)
        dckpt.save(_write_state(add), path, **kw)
        got = _write_state(0, zero=True)
        dckpt.load(got, path)
        out.append(_same_state(got, _write_state(add)) and verify_checkpoint(path).ok)
    from dckpt.engine import devstream

    devstream.STREAM_CPU = True  # each box's view through the GPU path's bounce blocks
    try:
        path = os.path.join(base, "streamed")
        dckpt.save(_write_state(5.0), path)
    finally:
        devstream.STREAM_CPU = False
    got = _write_state(0, zero=True)
    dckpt.load(got, path)
    out.append(_same_state(got, _write_state(5.0)) and verify_checkpoint(path).ok)
    path = os.path.join(base, "async")
    h = dckpt.async_save(_write_state(3.0), path)  # staged copies, rebuilt as DTensors
    h.result()
    got = _write_state(0, zero=True)
    dckpt.load(got, path)
    out.append(_same_state(got, _write_state(3.0)) and verify_checkpoint(path).ok)
    mgr = dckpt.CheckpointManager(os.path.join(base, "durable"), every_steps=1,
                                  capture_rng=False,
                                  local_root=os.path.join(base, f"node{dist.get_rank()}"))
    assert mgr.save(4, _write_state(4.0))
    mgr.close()
    mgr = dckpt.CheckpointManager(os.path.join(base, "durable"), every_steps=1,
                                  capture_rng=False,
                                  local_root=os.path.join(base, f"node{dist.get_rank()}"))
    got = _write_state(0, zero=True)
    step = mgr.restore(got)
    out.append((step, mgr.restored_from, _same_state(got, _write_state(4.0))))
    mgr.close()
    return out


def test_write_paths_with_several_boxes_per_rank(ranks, tmp_path):
    """A rank writing several chunks of one tensor into one file (its data file, and
    its fast-tier replica file) through every write path: compressed, incremental
    against a base, streamed through bounce blocks (the CUDA path, exercised on CPU),
    async (staging buffers), and the manager's fast tier restored on the same ranks
    (local, from each rank's own files)."""
    got = ranks(4).run(_write_paths, str(tmp_path))
    assert got == [[True, True, True, True, (4, "local", True)]] * 4


def test_verify_names_the_damaged_box_of_a_several_box_file(ranks, tmp_path):
    """A file holding two boxes of ``big`` (``key@offsets``), damaged in the box the
    manifest lists second for it: verify names that box's own rows of ``big``."""
    from dckpt.format import manifest as mf
    from dckpt.engine.reader import ChunkReader, stored_name
    from dckpt.storage.fsspec_storage import make_storage
    from dckpt.catalog.verify import verify_checkpoint

    path = str(tmp_path / "views")
    ranks(4).run(_save_big, path, "views")
    storage, root = make_storage(path, None)
    m = mf.parse(storage.read(storage.join(root, mf.MANIFEST_NAME), 0,
                              storage.size(storage.join(root, mf.MANIFEST_NAME))))
    c = m.tensors["big"].chunks
    files = c.file.tolist()
    fi = next(f for f in files if files.count(f) == 2)
    ci = max(i for i, f in enumerate(files) if f == fi)  # the file's second chunk
    row, n = int(c.offsets[ci][0]), int(c.sizes[ci][0])
    st = ChunkReader(storage, root, m).header(fi)[0][stored_name("big", c.offsets[ci])]
    target = storage.join(root, m.files[fi].name)
    data = bytearray(storage.read(target, 0, m.files[fi].size))
    data[st.start] ^= 0xFF
    with open(target, "wb") as fh:
        fh.write(bytes(data))
    problems = verify_checkpoint(path).problems
    assert len(problems) == 1, problems
    assert f"hold big[{row}, 0].." in problems[0], problems
    assert f"in its saved chunk big[{row}:{row + n}, 0:{COLS}]" in problems[0], problems
