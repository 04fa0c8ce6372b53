"""Test helpers: states with every dtype and leaf kind, empty twins, exact comparison,
and what a CheckpointManager left on disk."""
from __future__ import annotations

import os

import torch

from dckpt.format.dtypes import _TORCH

ALL_DTYPES = list(_TORCH)


def rand(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 120, shape, generator=gen).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (equality of NaNs and float8 included)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(a, DTensor):
            a, b = a.to_local(), b.to_local()
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(bits(a), bits(b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def plain_state(seed: int = 0) -> dict:
    """Every dtype, a 0-d tensor, an empty tensor, a non-contiguous view, and JSON leaves
    in nested dict / list / tuple."""
    g = torch.Generator().manual_seed(seed)
    sd: dict = {"dtypes": {str(dt).split(".")[-1]: rand((3, 5), dt, g) for dt in ALL_DTYPES}}
    sd["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    sd["scalar_bf16"] = rand((), torch.bfloat16, g)
    sd["empty"] = torch.zeros(0, 4)
    base = rand((6, 4), torch.float32, g)
    sd["view_t"] = base.t()  # non-contiguous
    sd["view_slice"] = base[::2, 1:3]
    sd["nested"] = {"list": [rand((2,), torch.int32, g), {"deep": rand((1, 1, 2), torch.float16, g)}],
                    "tuple": (1, "two", None, 3.25, True, rand((4,), torch.int64, g))}
    sd["step"] = 12
    sd["lr"] = 3e-4
    sd["name"] = "run-α"
    sd["flag"] = False
    sd["nothing"] = None
    return sd


def zeros_like_state(sd):
    """The same structure with zeroed tensors (same layout) and blanked JSON leaves."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(sd, DTensor):
        return distribute_tensor(torch.zeros(sd.shape, dtype=sd.dtype), sd.device_mesh, sd.placements,
                                 src_data_rank=None)  # no collective: gloo lacks some dtypes
    if isinstance(sd, torch.Tensor):
        return torch.zeros(sd.shape, dtype=sd.dtype)
    if isinstance(sd, dict):
        return {k: zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like_state(v) for v in sd]
    if isinstance(sd, tuple):
        return tuple(zeros_like_state(v) for v in sd)
    return {bool: False, int: 0, float: 0.0, str: "", type(None): None}[type(sd)]


def has_manifest(root, step: int) -> bool:
    """Whether ``root/step-<step>`` (a CheckpointManager's layout) holds a committed
    checkpoint."""
    return os.path.exists(os.path.join(str(root), f"step-{step:08d}", "manifest.json"))


def fsdp2_mlp(dims: tuple[int, int, int], seed: int, lr: float = 0.01):
    """Linear(d0, d1) -> ReLU -> Linear(d1, d2), each Linear and the whole fully_shard'ed
    over every rank (CPU mesh), and an AdamW over it. Call inside a process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    d0, d1, d2 = dims
    model = torch.nn.Sequential(torch.nn.Linear(d0, d1), torch.nn.ReLU(), torch.nn.Linear(d1, d2))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def flip_byte(path: str, at: int, mask: int = 0x01) -> None:
    """XOR the byte at offset ``at`` of ``path`` with ``mask`` (a bit flip on disk)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))
