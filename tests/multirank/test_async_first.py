"""prepare_async_save at 2 gloo ranks (issue 34, section 3): it makes the saver's own
checkpoint group together on every rank and touches each rank's staging buffers for
its DTensor shards, so the first async_save's call takes no page faults of its own and
saves what the state held at the call."""
from __future__ import annotations

import resource

import torch
import torch.distributed as dist

MIB = 32


def _prepared_first_call(path: str) -> tuple[int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dckpt
    from dckpt.protocol.async_save import async_save, prepare_async_save

    group = dist.new_group(backend="gloo")  # a fresh saver: no buffers from other tests
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.rand(dist.get_world_size() * MIB, 1 << 18, generator=torch.Generator().manual_seed(3))
    sd = {"w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None), "step": 5}

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    f0 = faults()
    assert prepare_async_save(sd, process_group=group) == MIB << 20
    f1 = faults()
    h = async_save(sd, path, process_group=group)
    f2 = faults()
    sd["w"].to_local().zero_()  # after the call: not in the checkpoint
    h.result(timeout=60)
    back = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)], src_data_rank=None),
            "step": 0}
    dckpt.load(back, path)
    assert torch.equal(back["w"].full_tensor(), full) and back["step"] == 5
    return f1 - f0, f2 - f1


def test_prepare_takes_the_first_calls_page_faults(ranks, tmp_path):
    pages = (MIB << 20) // 4096
    for prepared, in_call in ranks(2).run(_prepared_first_call, str(tmp_path / "c")):
        assert prepared > 0.8 * pages and in_call < 0.1 * pages, (prepared, in_call)
