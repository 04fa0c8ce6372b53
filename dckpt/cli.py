"""``dckpt`` command line: ls, inspect, verify, gc."""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import sys

from .errors import CheckpointError


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _when(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def cmd_ls(args) -> int:
    from .catalog import list_checkpoints

    found = list_checkpoints(args.root, _opts(args))
    if not found:
        print(f"no checkpoints under {args.root}")
        return 0
    rows = [[s.path, "committed" if s.committed else f"BROKEN: {s.problem}", _size(s.bytes),
             str(s.files), str(s.tensors), str(s.world_size), _when(s.created)] for s in found]
    print(_table(rows, ["path", "state", "size", "files", "tensors", "ranks", "saved"]))
    return 0


def cmd_inspect(args) -> int:
    from .catalog import sharding
    from .dist.restore import read_manifest
    from .storage.fsspec_storage import make_storage

    storage, root = make_storage(args.path, _opts(args))
    m, raw = read_manifest(storage, root)
    if args.json:
        print(raw.decode())
        return 0
    print(f"checkpoint {root}\n  saved {_when(m.created)} by {m.world_size} rank(s), "
          f"{len(m.files)} file(s), {_size(m.total_bytes)}, save id {m.save_id}\n")
    rows = [[k, t.dtype, "x".join(map(str, t.shape)) or "scalar", sharding(t),
             str(len(t.chunks)), _size(t.nbytes)] for k, t in m.tensors.items()]
    print(_table(rows, ["tensor", "dtype", "shape", "sharding", "chunks", "bytes"]))
    if m.values:
        print()
        print(_table([[k, json.dumps(v)] for k, v in m.values.items()], ["value", "json"]))
    return 0


def cmd_verify(args) -> int:
    from .verify import verify_checkpoint

    r = verify_checkpoint(args.path, _opts(args))
    if r.ok:
        print(f"OK {r.path}: {r.files} file(s), {_size(r.bytes_checked)} checked")
        return 0
    print(f"FAILED {r.path}: {len(r.problems)} problem(s)")
    for p in r.problems:
        print(f"  - {p}")
    return 1


def cmd_gc(args) -> int:
    from .catalog import collect_garbage

    found = collect_garbage(args.root, dry_run=args.dry_run, min_age_s=args.min_age,
                            storage_options=_opts(args))
    verb = "would remove" if args.dry_run else "removed"
    for lo in found:
        print(f"{verb} {lo.path} ({_size(lo.bytes)}, {lo.age_s / 60:.0f} min old)")
    print(f"{verb} {len(found)} leftover file(s), {_size(sum(lo.bytes for lo in found))}")
    return 0


def _opts(args) -> dict | None:
    return json.loads(args.storage_options) if args.storage_options else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dckpt", description="Inspect and maintain dckpt checkpoints.")
    p.add_argument("--storage-options", help="JSON object of fsspec storage options")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("ls", help="list committed checkpoints under ROOT")
    s.add_argument("root")
    s.set_defaults(fn=cmd_ls)
    s = sub.add_parser("inspect", help="show every tensor of a checkpoint")
    s.add_argument("path")
    s.add_argument("--json", action="store_true", help="print the raw manifest")
    s.set_defaults(fn=cmd_inspect)
    s = sub.add_parser("verify", help="check every checksum; exit 1 listing failures")
    s.add_argument("path")
    s.set_defaults(fn=cmd_verify)
    s = sub.add_parser("gc", help="remove leftovers of failed saves under ROOT")
    s.add_argument("root")
    s.add_argument("--dry-run", action="store_true", help="list, remove nothing")
    s.add_argument("--min-age", type=float, default=3600.0, metavar="SECONDS",
                   help="only files older than this (default 3600: never a save in progress)")
    s.set_defaults(fn=cmd_gc)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except CheckpointError as e:
        print(f"dckpt {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
