"""dckpt.load_hf on real gloo ranks: Hugging Face safetensors loaded in place into an
FSDP2 model (2 ranks) and FSDP2 + TP models on 2-D meshes ((1, 3) at 3 ranks, (2, 2) at
4), equal to loading the files whole; explicit DTensors (column slices, 2-D boxes,
_StridedShard) read at most their own bytes plus 64 KiB per box, counted at the storage
layer, and only rank 0 reads headers; a failure on one rank is the same error on every
rank."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

D, HIDDEN, VOCAB = 48, 100, 70  # 100 and 70 split unevenly over 3 and 2


class Block(torch.nn.Module):
    """A torchtitan-like block: embedding, attention-like mixer, SwiGLU MLP, output."""

    def __init__(self) -> None:
        super().__init__()
        L = torch.nn.Linear
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.norm = torch.nn.LayerNorm(D)
        self.wq, self.wo = L(D, D, bias=False), L(D, D, bias=False)
        self.w1, self.w3, self.w2 = L(D, HIDDEN, bias=False), L(D, HIDDEN, bias=False), \
            L(HIDDEN, D, bias=False)
        self.out = L(D, VOCAB, bias=False)


def _build(dp: int, tp: int, seed: int) -> torch.nn.Module:
    """Block under FSDP2 over ``dp`` and TP over ``tp`` (torchtitan's plan: colwise
    wq/w1/w3/out, rowwise wo/w2/emb; each block then the root fully_shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(seed)
    model = Block()
    if tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        col, row = ColwiseParallel(), RowwiseParallel()
        parallelize_module(model, mesh["tp"], {
            "emb": RowwiseParallel(input_layouts=Replicate()), "wq": col, "wo": row,
            "w1": col, "w3": col, "w2": row, "out": ColwiseParallel(output_layouts=Replicate())})
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    for name in ("wq", "wo", "w1", "w3", "w2"):
        fully_shard(getattr(model, name), mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _hf_names(k: str) -> str:
    return "model." + k


def _write_hf(d: str) -> dict:
    """The plain block (seed 0) as two safetensors files and an index, HF-named, the
    MLP weights stored in bf16 (loaded into fp32: cast)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    sd = {_hf_names(k): v.detach().clone() for k, v in Block().state_dict().items()}
    for k in list(sd):
        if ".w1." in k or ".w3." in k:
            sd[k] = sd[k].bfloat16()
    sd["model.rotary.inv_freq"] = torch.rand(8)  # in the files, not in the model: fine
    os.makedirs(d, exist_ok=True)
    keys = sorted(sd)
    wm = {}
    for i, part in enumerate((keys[::2], keys[1::2])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, os.path.join(d, name), metadata={"format": "pt"})
        wm.update({k: name for k in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return sd


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hf") / "block")
    return d, _write_hf(d)


class _Count:
    """Bytes read through the storage layer on this rank: tensor data (the readers'
    readv) and whole-call reads (headers, the index)."""

    def __init__(self) -> None:
        from dckpt.storage import local

        self.local, self.data, self.meta = local, 0, 0
        self.readv, self.read, self.read_file = (local.LocalReader.readv,
                                                 local.LocalStorage.read,
                                                 local.LocalStorage.read_file)
        me = self

        def readv(s, start, bufs):
            n = me.readv(s, start, bufs)
            me.data += n
            return n

        def read(s, path, start=0, length=None):
            out = me.read(s, path, start, length)
            me.meta += len(out)
            return out

        def read_file(s, path, cap):
            out = me.read_file(s, path, cap)
            me.meta += len(out)
            return out

        local.LocalReader.readv, local.LocalStorage.read = readv, read
        local.LocalStorage.read_file = read_file

    def close(self) -> None:
        self.local.LocalReader.readv, self.local.LocalStorage.read = self.readv, self.read
        self.local.LocalStorage.read_file = self.read_file


def _load_model(path: str, dp: int, tp: int):
    """Load the HF files into the block's state dict under (dp, tp), as torchtitan's
    initial_load_in_hf does (the state dict's DTensors are the parameters' views)."""
    import dckpt
    from torch.distributed.tensor import DTensor

    model = _build(dp, tp, seed=7)  # other values: the load must replace them all
    sd = {_hf_names(k): v for k, v in model.state_dict().items()}
    count = _Count()
    try:
        info = dckpt.load_hf(sd, path)
    finally:
        count.close()
    full = {_hf_names(k): (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}
    placements = {k: str(tuple(v.placements)) for k, v in model.state_dict().items()
                  if isinstance(v, DTensor)}
    return full, placements, info, count.data, count.meta


@pytest.mark.parametrize("world, dp, tp", [(2, 2, 1), (3, 1, 3), (4, 2, 2)])
def test_model_equals_loading_the_files_whole(ranks, hf, world, dp, tp):
    path, want = hf
    out = ranks(world).run(_load_model, path, dp, tp, timeout=180)
    placements = out[0][1]
    print(f"\nblock at (dp={dp}, tp={tp}): read/share per rank (bytes): "
          + ", ".join(f"{o[3]}/{o[2].bytes_needed[r]}" for r, o in enumerate(out)))
    if tp > 1:  # what is being tested: FSDP2 over TP, strided and 2-D boxes
        assert "_StridedShard" in placements["w1.weight"], placements
        assert "Shard(dim=1)" in placements["wo.weight"], placements
    for r, (full, _, info, data, meta) in enumerate(out):
        assert sorted(full) == sorted(k for k in want if "rotary" not in k)
        for k, v in full.items():
            assert v.dtype == torch.float32 and torch.equal(v, want[k].float()), (r, k)
        assert info.bytes_read[r] == data and info.bytes_needed[r] <= data
        assert (meta > 0) == (r == 0)  # only rank 0 reads the index and headers
    needed = out[0][2].bytes_needed
    total = sum(v.numel() * v.element_size() for k, v in want.items() if "rotary" not in k)
    assert sum(needed) >= total and max(needed) < total  # each rank a share, not all


# ------------------------------------------------------------ bytes read per rank

ROWS, COLS = 1024, 768  # F32 rows of 3 KiB: 3 MiB a tensor


def _big(dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.25 - 9).to(dtype)


def _dt(kind: str, t: torch.Tensor):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    world = dist.get_world_size()
    if kind == "cols":  # rowwise TP alone: a column slice per rank (uneven at 3)
        return distribute_tensor(t, init_device_mesh("cpu", (world,)), [Shard(1)])
    if kind == "rows":  # FSDP2 alone
        return distribute_tensor(t, init_device_mesh("cpu", (world,)), [Shard(0)])
    if kind == "rep":
        return distribute_tensor(t, init_device_mesh("cpu", (world,)), [Replicate()])
    mesh = init_device_mesh("cpu", (2, world // 2))
    if kind == "2d":  # FSDP2 over rowwise TP: row block x column slice
        return distribute_tensor(t, mesh, [Shard(0), Shard(1)])
    if kind == "fsdp_tp":  # FSDP2 over colwise TP: one strided box per rank
        return distribute_tensor(t, mesh, [_StridedShard(0, split_factor=2), Shard(0)])
    assert kind == "views"  # two interleaved boxes per rank
    return distribute_tensor(t, mesh, [Shard(0), _StridedShard(0, split_factor=2)])


def _load_big(path: str, kind: str):
    import dckpt
    from dckpt.state.tensors import describe_all

    state = {"w": _dt(kind, torch.zeros(ROWS, COLS)), "bf": _dt(kind, torch.zeros(ROWS, COLS))}
    count = _Count()
    try:
        info = dckpt.load_hf(state, path)
    finally:
        count.close()
    assert torch.equal(state["w"].full_tensor(), _big())
    assert torch.equal(state["bf"].full_tensor(), _big(torch.bfloat16).float())
    assert torch.equal(state["w"].to_local(), _dt(kind, _big()).to_local())
    pieces = [p for k in ("w", "bf") for p in describe_all(k, state[k]) if p.box.numel]
    share = sum(p.box.numel * (4 if p.key == "w" else 2) for p in pieces)
    return count.data, share, len(pieces), info.bytes_read[dist.get_rank()], count.meta


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    from safetensors.torch import save_file

    path = str(tmp_path_factory.mktemp("big") / "model.safetensors")
    save_file({"bf": _big(torch.bfloat16), "w": _big(), "other": torch.ones(1000)}, path)
    return path


@pytest.mark.parametrize("world, kind", [(3, "cols"), (3, "rows"), (3, "rep"), (4, "2d"),
                                         (4, "fsdp_tp"), (4, "views"), (2, "cols")])
def test_each_rank_reads_its_share_plus_at_most_64_KiB_per_box(ranks, big, world, kind):
    """Counted at the storage layer: each rank reads its boxes' bytes, plus at most 64
    KiB per box (joined gaps between the row segments of a column slice); row boxes
    exactly their bytes. A column slice's whole span would be about 3x its share."""
    from dckpt.interop.hf_read import WASTE

    out = ranks(world).run(_load_big, big, kind, timeout=180)
    print(f"\n{kind} at {world} ranks: read/share per rank (KiB): "
          + ", ".join(f"{d / 1024:.0f}/{s / 1024:.0f}" for d, s, *_ in out))
    for r, (data, share, npieces, reported, meta) in enumerate(out):
        assert reported == data
        assert share <= data <= share + WASTE * npieces, (r, data, share, npieces)
        if kind in ("rows", "rep", "fsdp_tp", "views"):
            assert data == share
        assert (meta > 0) == (r == 0)
    if kind in ("cols", "2d"):
        # the joins do happen (fewer requests) and stay within the allowance
        assert all(d > s for d, s, *_ in out)


# ------------------------------------------------------------ errors on every rank

def _error_on(path: str, case: str):
    """Run a failing load; returns (error type, message) on this rank."""
    import dckpt

    r = dist.get_rank()
    state = {"w": _dt("rows", torch.zeros(ROWS, COLS))}
    kw = {}
    if case == "missing" and r == 1:
        state["nope"] = torch.zeros(2)
    if case == "shape" and r == 2:
        state["other"] = torch.zeros(999)
    from dckpt.storage import local

    real = local.LocalReader.readv
    if case == "read" and r == 1:
        def broken(self, start, bufs):
            raise OSError(5, "Input/output error")

        local.LocalReader.readv = broken
    try:
        dckpt.load_hf(state, path, **kw)
    except dckpt.CheckpointError as e:
        return type(e).__name__, str(e), sorted(e.failures)
    finally:
        local.LocalReader.readv = real
    return None


@pytest.mark.parametrize("case, typ, want, failing", [
    ("hostile", "CheckpointError", r"failed on rank 0: .*model\.safetensors.*'w'.*byte range", [0]),
    ("missing", "StateMismatchError", r"failed on rank 1: .*lack 1 key.*'nope'", [1]),
    ("shape", "StateMismatchError", r"failed on rank 2: .*'other' has shape \[999\] in the state "
                                    r"and \[1000\] in .*model\.safetensors", [2]),
    ("read", "CheckpointError", r"failed on rank 1: .*model\.safetensors: reading tensor 'w' "
                                r"failed .*Input/output error", [1]),
])
def test_a_failure_on_one_rank_is_the_same_error_on_every_rank(ranks, big, tmp_path, case,
                                                               typ, want, failing):
    import re

    path = big
    if case == "hostile":
        raw = open(big, "rb").read()
        n = int.from_bytes(raw[:8], "little")
        head = json.loads(raw[8:8 + n])
        head["w"]["data_offsets"][1] += 4  # no longer shape x itemsize
        new = json.dumps(head).encode()
        new += b" " * (-len(new) % 8)
        path = str(tmp_path / "model.safetensors")
        with open(path, "wb") as f:
            f.write(len(new).to_bytes(8, "little") + new + raw[8 + n:])
    out = ranks(3).run(_error_on, path, case, timeout=120)
    assert all(o is not None for o in out), out
    assert len(set(out_msg for _, out_msg, _ in out)) == 1, out  # the same message
    typ_got, msg, failures = out[0]
    assert typ_got == typ and re.search(want, msg), msg
    assert failures == failing
