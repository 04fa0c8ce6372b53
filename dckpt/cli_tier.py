"""``dckpt inspect`` of a fast-tier step (a ``local_root``'s ``step-<N>/``), and the help
text that says what a fast-tier directory holds. Torch-free: JSON and listings only."""
from __future__ import annotations

from .catalog_local import mf_name, ranks_text, read_local_step
from .errors import CheckpointError
from .progress import size_text

FAST_TIER = (
    "ROOT may also be a fast-tier directory (a CheckpointManager's local_root, e.g. "
    "/dev/shm/run): it holds step-<N>/ directories with, for each rank of this node, "
    "data-<id>-<rank>.safetensors (its share of the save), replica-<id>-<rank>.safetensors "
    "(replicated chunks it keeps to restore without another node) and manifest-<rank>.json "
    "(its view of the global manifest). It is recognised by those views, no flag needed. A "
    "step is complete on this node when every rank of the world size its views declare "
    "has a view here, all of one save, with its files at their recorded sizes; on a "
    "multi-node job each node holds only its own ranks' views.")


def inspect_local(storage, where: str, shown: str, args) -> int:
    """Print fast-tier step ``where``: its save, the ranks whose view this node holds
    (and their files), whether it is complete on this node, and its tensors (the global
    manifest, which every view carries). ``--json``: the raw view of ``--rank`` (default
    the lowest rank here). Blocking I/O: one listing and one read per view. Raises
    CheckpointError when no view is readable or ``--rank`` has none here."""
    from .cli import _when, _table, print_tensors

    step = read_local_step(storage, where, shown)
    if not step.views:
        raise CheckpointError(f"{shown}: no readable rank view ({step.state()})")
    rank = min(step.views) if args.rank is None else args.rank
    if rank not in step.views:
        raise CheckpointError(f"{shown} holds no readable view of rank {rank} (views here: "
                              f"{ranks_text(step.views)})")
    if args.json:
        print(step.raw[rank].decode())
        return 0
    m = step.views[rank]
    print(f"fast-tier step {shown}\n  saved {_when(m.created)} by {m.world_size} rank(s), "
          f"save id {m.save_id}, {size_text(m.total_bytes)} in all\n  views of rank(s) "
          f"{ranks_text(step.views)} here ({step.files} file(s), {size_text(step.bytes)}): "
          f"{step.state()}\n")
    rows = []
    for r, v in sorted(step.views.items()):
        held = [v.files[i] for i in step.held_files(r)]
        rows.append([str(r), mf_name(r), ", ".join(
            f"{f.name} ({size_text(f.size)})" for f in held) or "-"])
    print(_table(rows, ["rank", "view", "its files"]))
    print()
    print_tensors(m)
    return 0
