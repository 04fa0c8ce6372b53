"""``dckpt diff A B``: the subcommand's arguments and its printing (the comparison is
:func:`dckpt.view.diff.diff`). Exit status as diff(1): 0 equal, 1 different, 2 error.
Nothing here imports torch until the command runs."""
from __future__ import annotations

import logging
import math

from .show import table
from ..errors import CheckpointError

# Structural statuses after the changed tensors, in this order; equal keys last.
_RANK = {"changed": 0, "shape": 1, "dtype": 2, "added": 3, "removed": 4, "equal": 5}


def add_parser(sub) -> None:
    """Register ``diff`` on the CLI's subparsers."""
    s = sub.add_parser(
        "diff", help="compare two checkpoints by value, key by key (exit 0 equal, 1 "
                     "different, 2 error)",
        description="Compare checkpoint A (old) with B (new) by value, whatever the ranks "
        "and layouts that saved them: per key equal, changed (max abs diff, relative L2 "
        "norm of the difference, elements that differ), added (only in B), removed (only "
        "in A), shape or dtype. Tensors are streamed in slabs: memory stays bounded "
        "whatever the checkpoints' size. Exit 0 when equal (|a-b| <= atol + rtol*|b| "
        "everywhere), 1 when different, 2 on error. See docs/DIFF.md.")
    s.add_argument("a", help="the old checkpoint (path or fsspec URL)")
    s.add_argument("b", help="the new checkpoint (path or fsspec URL)")
    s.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    s.add_argument("--rtol", type=float, default=0.0,
                   help="relative tolerance, times |b| (default 0: exact)")
    s.add_argument("--keys", action="append", metavar="PREFIX",
                   help="only the keys under this dotted prefix (repeatable)")
    s.add_argument("--json", action="store_true",
                   help='print one JSON object {"equal": ..., "keys": [...]}')
    s.add_argument("--all", action="store_true", help="list the equal keys too")
    s.add_argument("--storage-options-a", metavar="JSON",
                   help="fsspec storage options for A only (default --storage-options)")
    s.add_argument("--storage-options-b", metavar="JSON",
                   help="fsspec storage options for B only (default --storage-options)")
    s.add_argument("--slab-mib", type=int, default=64, metavar="N",
                   help="read at most N MiB per side at a time (default 64; memory is "
                        "about 2N MiB + 48 MiB)")
    s.set_defaults(fn=cmd_diff)


def cmd_diff(args) -> int:
    from .common import _opts, _shown
    from ..view.diff import diff

    if args.slab_mib < 1:
        raise CheckpointError(f"--slab-mib must be at least 1, not {args.slab_mib}")
    both = _opts(args)
    opts = (_side(args.storage_options_a, "a", both), _side(args.storage_options_b, "b", both))
    # The progress line past 10 s (DCKPT_PROGRESS_SECONDS) shows without -v, as a long
    # diff is what a user watches; other INFO records stay behind -v.
    logging.getLogger("dckpt.view.diff").setLevel(logging.INFO)
    r = diff(args.a, args.b, atol=args.atol, rtol=args.rtol, keys=args.keys,
             storage_options=opts, slab_bytes=args.slab_mib << 20)
    if args.json:
        print(r.to_json())
    else:
        print(render(r, _shown(args.a, r.a), _shown(args.b, r.b), show_equal=args.all))
    return 0 if r.equal else 1


def _side(text: str | None, which: str, default: dict | None) -> dict | None:
    from .common import json_opts

    return default if text is None else json_opts(text, f"--storage-options-{which}")


def order(keys: list) -> list:
    """KeyDiffs with the largest differences first: changed tensors by max abs diff
    (then by elements that differ), changed JSON values, then shape, dtype, added,
    removed, equal; key order within each. Pure."""
    def rank(i_k):
        i, k = i_k
        big = k.max_abs_diff if k.max_abs_diff is not None else -1.0
        big = math.inf if math.isnan(big) else big
        return (_RANK[k.status], -big, -(k.n_diff or 0), i)
    return [k for _, k in sorted(enumerate(keys), key=rank)]


def _g(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def _tol(x: float) -> str:
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


def render(r, a: str, b: str, show_equal: bool = False) -> str:
    """The text report: a header, the table (equal keys only with ``show_equal``) and
    the summary line. Pure."""
    rows = []
    for k in order(r.keys):
        if k.status == "equal" and not show_equal:
            continue
        n = "-" if k.n_diff is None else (f"{k.n_diff}/{k.numel}" if k.numel else str(k.n_diff))
        rows.append([k.key, k.status, _g(k.max_abs_diff, 4), _g(k.rel_l2, 3), n,
                     k.detail or ""])
    tol = "exact" if not (r.atol or r.rtol) else f"atol {_tol(r.atol)}, rtol {_tol(r.rtol)}"
    lines = [f"--- {a}", f"+++ {b}"]
    if rows:
        lines += ["", table(rows, ["key", "status", "max abs diff", "rel L2", "n diff",
                                   "detail"])]
    verdict = "equal" if r.equal else "different"
    lines += ["", f"{r.summary()} ({tol}): {verdict}"]
    return "\n".join(lines)
