"""What the CLI prints about a checkpoint: tables, a manifest's tensors (how each is cut,
what lives in siblings), a fast-tier step (a ``local_root``'s ``step-<N>/``), and the help
text that says what a fast-tier directory holds. Pure or JSON and listings only:
torch-free."""
from __future__ import annotations

import datetime as _dt
import json

from ..catalog.local import mf_name, ranks_text, read_local_step
from ..errors import CheckpointError
from ..format import manifest as mf, sealed
from ..progress import size_text


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def when(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def sharding(t: mf.TensorEntry) -> str:
    """A short description of how a tensor's chunks cut it, e.g. ``4 x dim0``."""
    n = len(t.chunks)
    if n <= 1:
        return "whole"
    if t.chunks.grid is not None:
        cuts = [f"{len(b) - 1} x dim{d}" for d, b in enumerate(t.chunks.grid) if len(b) > 2]
        return ", ".join(cuts)
    return f"{n} chunks"


def inherited(m: mf.Manifest, t: mf.TensorEntry) -> str:
    """What of tensor ``t`` lives in sibling checkpoints: ``-`` (nothing), ``all``, or
    ``k/n blocks``. Pure."""
    total = ref = 0
    for ci, fi in enumerate(t.chunks.file.tolist()):
        enc = t.encoded(ci)
        if enc is None:
            n = len(t.blocks[ci].hashes) // 16 if t.blocks is not None else 1
            total += n
            ref += n if m.files[fi].dir else 0
        else:
            total += len(enc)
            ref += sum(1 for f in enc[:, 0].tolist() if m.files[f].dir)
    if not ref:
        return "-"
    return "all" if ref == total else f"{ref}/{total} blocks"


def value_text(v) -> str:
    """A manifest value for the table: its JSON, except a bytes value, shown as its
    length and a hex prefix (``bytes[1234] 80049512...``), not its base64. Pure."""
    return sealed.bytes_text(sealed.user_value(v)) if sealed.is_bytes_tag(v) else json.dumps(v)


def print_tensors(m) -> None:
    """A manifest's tensor table and, if any, its JSON values."""
    # a bytes value too large for the manifest is an entry of a data file: dtype "bytes"
    rows = [[k, "bytes" if t.bytes_value else t.dtype, "x".join(map(str, t.shape)) or "scalar",
             sharding(t), str(len(t.chunks)), size_text(t.nbytes), inherited(m, t)]
            for k, t in m.tensors.items()]
    print(table(rows, ["tensor", "dtype", "shape", "sharding", "chunks", "bytes", "inherited"]))
    if m.values:
        print()
        print(table([[k, value_text(v)] for k, v in m.values.items()], ["value", "json"]))

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
    print(f"fast-tier step {shown}\n  saved {when(m.created)} by {m.world_size} rank(s), "
          f"save id {m.save_id}, {size_text(m.total_bytes)} in all\n  views of rank(s) "
          f"{ranks_text(step.views)} here ({step.files} file(s), {size_text(step.bytes)}): "
          f"{step.state()}\n")
    rows = []
    for r, v in sorted(step.views.items()):
        held = [v.files[i] for i in step.held_files(r)]
        rows.append([str(r), mf_name(r), ", ".join(
            f"{f.name} ({size_text(f.size)})" for f in held) or "-"])
    print(table(rows, ["rank", "view", "its files"]))
    print()
    print_tensors(m)
    return 0
