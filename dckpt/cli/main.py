"""``dckpt`` command line: ls, inspect, verify, gc, export, import, history, diff.

Every error is one line ``dckpt <cmd>: <message>`` on stderr and exit status 2 (the
traceback too under ``-v``); ``verify`` exits 1 when it finds damage. Paths are printed
as the user wrote them where they are URLs, so a printed path can be passed back.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback

from .show import print_tensors, table as _table, when as _when
from .common import _as_typed, _opts, _shown
from ..errors import CheckpointError, NotCommittedError
from ..progress import size_text


def cmd_ls(args) -> int:
    from ..catalog.listing import list_checkpoints

    found = list_checkpoints(args.root, _opts(args))
    if not found:
        print(f"no checkpoints under {args.root}")
        return 0
    rows = [[s.path, _state(s), size_text(s.bytes), str(s.files), str(s.tensors),
             str(s.world_size), _when(s.created)] for s in found]
    header = ["path", "state", "size", "files", "tensors", "ranks", "saved"]
    if any(s.tier == "local" for s in found):  # a local_root: which ranks' views are here
        from ..catalog.local import ranks_text

        header.insert(6, "views")
        for r, s in zip(rows, found):
            r.insert(6, ranks_text(s.views) if s.tier == "local" else "-")
    print(_table(rows, header))
    return 0


def _state(s) -> str:
    if s.tier == "local":
        return "local: complete on this node" if s.committed else f"local: {s.problem}"
    return "committed" if s.committed else f"BROKEN: {s.problem}"


def cmd_inspect(args) -> int:
    from ..protocol.manifest_read import read_manifest
    from ..storage.fsspec_storage import make_storage

    storage, root = make_storage(args.path, _opts(args))
    try:
        m, raw = read_manifest(storage, root)
    except (NotCommittedError, NotADirectoryError):  # a file: "is a file, not a ..."
        from ..catalog.listing import expect_checkpoint

        if expect_checkpoint(storage, root, args.path) != "local":  # raises for a wrong path
            raise
        from .show import inspect_local

        return inspect_local(storage, root, _shown(args.path, root), args)
    if args.json:
        print(raw.decode())
        return 0
    print(f"checkpoint {_shown(args.path, root)}\n  saved {_when(m.created)} by {m.world_size} rank(s), "
          f"{len(m.files)} file(s), {size_text(m.total_bytes)}, save id {m.save_id}\n")
    print_tensors(m)
    return 0


def cmd_du(args) -> int:
    from ..catalog.listing import disk_usage

    found, total = disk_usage(args.root, _opts(args))
    rows = [[u.path, size_text(u.own), size_text(u.referenced), size_text(u.own + u.referenced)]
            for u in found]
    if rows:
        print(_table(rows, ["checkpoint", "owns", "references", "loads"]))
    n = sum(1 for u in found if u.replica)  # a local_root's peers/step-<N>
    peers = f" and {n} replicated step(s) in peers/" if n else ""
    print(f"{len(found) - n} checkpoint(s){peers}; {size_text(total)} on disk under "
          f"{args.root} (every file once: referenced bytes are shared)")
    return 0


def cmd_verify(args) -> int:
    from ..catalog.verify import verify_checkpoint

    r = verify_checkpoint(args.path, _opts(args))
    shown = _shown(args.path, r.path)
    what = shown
    if r.views:  # a fast-tier step: what this node holds
        from ..catalog.local import ranks_text

        what += f" (fast-tier step, views of rank(s) {ranks_text(r.views)}: {r.note})"
    if r.ok:
        print(f"OK {what}: {r.files} file(s), {size_text(r.bytes_checked)} checked")
        return 0
    print(f"FAILED {what}: {len(r.problems)} problem(s)")
    for p in r.problems:
        print(f"  - {_as_typed(p, r.path, shown)}")
    return 1


def cmd_gc(args) -> int:
    from ..catalog.gc import collect_garbage

    found = collect_garbage(args.root, dry_run=args.dry_run, min_age_s=args.min_age,
                            storage_options=_opts(args))
    verb = "would remove" if args.dry_run else "removed"
    for lo in found:
        what = "incomplete upload, " if lo.upload_id else ""
        print(f"{verb} {lo.path} ({what}{size_text(lo.bytes)}, {lo.age_s / 60:.0f} min old)")
    n = sum(1 for lo in found if lo.upload_id)
    uploads = f" and {n} incomplete upload(s)" if n else ""
    print(f"{verb} {len(found) - n} leftover file(s){uploads}, "
          f"{size_text(sum(lo.bytes for lo in found))}")
    return 0


def cmd_export(args) -> int:
    from ..interop import export

    try:
        share = _export_share(args)
        if share is not None:
            return share
        info = export(args.ckpt, args.out_dir, prefix=args.prefix, dtype=args.dtype,
                      max_shard_size=args.max_shard_size, storage_options=_opts(args),
                      overwrite=args.overwrite)
    except NotCommittedError:
        from ..catalog.listing import expect_checkpoint
        from ..storage.fsspec_storage import make_storage

        storage, root = make_storage(args.ckpt, _opts(args))
        if expect_checkpoint(storage, root, args.ckpt) == "local":  # raises for a wrong path
            raise CheckpointError(
                f"{args.ckpt} is a fast-tier step (rank views manifest-<rank>.json, no "
                "manifest.json): export reads a durable checkpoint; export its durable "
                "copy, or restore this step with CheckpointManager") from None
        raise
    print(f"exported {info.tensors} tensor(s), {size_text(info.bytes)}, to {args.out_dir} in "
          f"{len(info.files)} file(s) ({info.seconds:.1f} s)")
    return 0


def _export_share(args) -> int | None:
    """``dckpt export --ranks N`` (N local worker processes) or under torchrun (each
    process its share, from RANK and WORLD_SIZE): the many-process export
    (:mod:`dckpt.interop.hf_export_ranks`); None for the one-process export."""
    import os

    from ..interop.hf_export_ranks import export_share

    kw = dict(prefix=args.prefix, max_shard_size=args.max_shard_size, dtype=args.dtype,
              storage_options=_opts(args), overwrite=args.overwrite)
    if args.ranks is None and "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except (KeyError, ValueError):
            raise CheckpointError("dckpt export under torchrun: RANK and WORLD_SIZE must be "
                                  "set to integers") from None
        plan = export_share(args.ckpt, args.out_dir, rank, world, **kw)
        if rank == 0:
            print(f"exported {sum(len(g) for g in plan.groups)} tensor(s) to {args.out_dir} "
                  f"in {len(plan.names)} file(s) from {world} processes")
        return 0
    if args.ranks is None or args.ranks == 1:
        return None
    if args.ranks < 1:
        raise CheckpointError(f"--ranks {args.ranks}: give at least 1")
    import time

    from ..interop.hf_export import _prepare_dir
    from ..storage.fsspec_storage import make_storage

    ostore, oroot = make_storage(args.out_dir, _opts(args))
    _prepare_dir(ostore, oroot, args.out_dir, args.overwrite)  # empty, or --overwrite
    t0 = time.perf_counter()
    plan = _run_workers(args.ckpt, args.out_dir, args.ranks, dict(kw, overwrite=True))
    print(f"exported {sum(len(g) for g in plan.groups)} tensor(s), "
          f"{size_text(sum(plan.sizes()))}, to {args.out_dir} in {len(plan.names)} file(s) "
          f"from {args.ranks} processes ({time.perf_counter() - t0:.1f} s)")
    return 0


def _run_workers(ckpt: str, out_dir: str, n: int, kw: dict):
    """Run the export's ``n`` shares in ``n`` spawned processes; return worker 0's
    plan. The first worker that fails (its error, or its death: a signal, no result)
    ends the others at once and its error is raised: rank 0 never waits out its
    deadline for a file that will not come. Blocking."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    procs, pipes = [], []
    for r in range(n):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_export_worker, args=(send, ckpt, out_dir, r, n, kw),
                        daemon=True, name=f"dckpt-export-{r}")
        p.start()
        send.close()
        procs.append(p)
        pipes.append(recv)
    results: dict[int, object] = {}
    try:
        while len(results) < n:
            ready = wait([pp for r, pp in enumerate(pipes) if r not in results]
                         + [procs[r].sentinel for r in range(n) if r not in results])
            for r in range(n):
                if r in results:
                    continue
                if pipes[r] in ready or pipes[r].poll():
                    try:
                        ok, value = pipes[r].recv()
                    except EOFError:
                        ok, value = False, None
                elif procs[r].sentinel in ready:
                    ok, value = False, None
                else:
                    continue
                if not ok:
                    procs[r].join(5)
                    why = value if value is not None else (
                        f"it ended with exit code {procs[r].exitcode} and no result")
                    raise CheckpointError(f"export worker {r} of {n} failed: {why}")
                results[r] = value
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    return results[0]


def _export_worker(conn, ckpt: str, out_dir: str, rank: int, world: int, kw: dict) -> None:
    from ..interop.hf_export_ranks import export_share

    try:
        conn.send((True, export_share(ckpt, out_dir, rank, world, **kw)))
    except BaseException as e:  # the parent raises it, naming this worker
        conn.send((False, f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def cmd_import(args) -> int:
    from ..interop import import_checkpoint

    aliases = {}
    for a in args.alias or []:
        new, eq, old = a.partition("=")
        if not (eq and new and old):
            raise CheckpointError(f"--alias {a!r} must be NEW=EXISTING")
        aliases[new] = old
    from ..interop.importer import deepspeed_tag

    if args.format == "deepspeed" or (args.format == "auto" and deepspeed_tag(args.src)):
        from ..integrations.deepspeed.stock import import_tag

        if args.prefix or aliases:
            raise CheckpointError("--prefix and --alias do not apply to a DeepSpeed tag")
        info = import_tag(args.src, args.dst, storage_options=_opts(args),
                          overwrite=args.overwrite, compression=args.compression)
    else:
        info = import_checkpoint(args.src, args.dst, format=args.format, prefix=args.prefix,
                                 aliases=aliases, overwrite=args.overwrite,
                                 max_shard_size=args.max_shard_size,
                                 compression=args.compression, storage_options=_opts(args))
    print(f"imported {args.src} into {info.path}: {size_text(info.bytes_written)} in "
          f"{info.num_files} file(s) ({info.seconds:.1f} s)")
    return 0


def cmd_history(args) -> int:
    from dataclasses import asdict

    from ..manager.history import HISTORY_FILE, read_history
    from ..storage.fsspec_storage import make_storage

    if args.last is not None and args.last < 0:
        raise CheckpointError(f"--last must be >= 0, not {args.last}")
    storage, root = make_storage(args.root, _opts(args))
    try:
        recs, bad = read_history(storage, root)
    except FileNotFoundError:
        raise CheckpointError(f"no save history in {args.root} (CheckpointManager writes "
                              f"{HISTORY_FILE} there after each committed save)") from None
    if args.tier != "all":
        recs = [r for r in recs if r.tier == args.tier]
    # File order is commit order, except records recovered at a restore: sort by time.
    recs.sort(key=lambda r: r.time)
    # --last N: the last N everywhere; without it the table shows 20, --json and
    # --plot every record. 0: all.
    picked = recs[-args.last:] if args.last else recs
    if args.plot:
        if not picked:
            raise CheckpointError(f"no save records to plot in {args.root}")
        from ..manager.history_plot import plot_history

        plot_history(picked, args.plot, title=args.root)
    if args.json:
        print(json.dumps([dict(asdict(r), throughput_bps=r.throughput) for r in picked]))
        return 0
    shown = picked if args.last is not None else recs[-20:]
    secs = lambda x: "-" if x is None else (f"{x:.3f} s" if x < 10 else f"{x:.1f} s")
    rows = [[_when(r.time), str(r.step), "-" if r.epoch is None else str(r.epoch), r.tier,
             r.mode, size_text(r.bytes), secs(r.blocking_s), secs(r.total_s),
             f"{size_text(int(r.throughput))}/s" if r.throughput else "-", str(r.world_size)]
            for r in shown]
    if rows:
        print(_table(rows, ["saved", "step", "epoch", "tier", "mode", "size", "blocking",
                            "total", "throughput", "ranks"]))
    skipped = f"; {bad} torn or corrupt line(s) skipped" if bad else ""
    print(f"{len(shown)} of {len(recs)} save(s) shown{skipped}"
          + (f"; plot written to {args.plot}" if args.plot else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dckpt", description="Inspect and maintain dckpt checkpoints.")
    p.add_argument("--storage-options", help="JSON object of fsspec storage options")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress; a traceback on error")
    sub = p.add_subparsers(dest="cmd", required=True)
    from .show import FAST_TIER

    s = sub.add_parser("ls", help="list committed checkpoints under ROOT, or the steps of a "
                                  "fast-tier directory (local_root) and their ranks' views",
                       description="List the committed checkpoints at ROOT and in its "
                       "direct subdirectories. " + FAST_TIER)
    s.add_argument("root")
    s.set_defaults(fn=cmd_ls)
    s = sub.add_parser("inspect", help="show every tensor of a checkpoint or fast-tier step",
                       description="Show a checkpoint's save, tensors and values. PATH may "
                       "be a fast-tier step (local_root/step-<N>): its ranks' views and "
                       "files on this node too. " + FAST_TIER.replace("ROOT", "Its parent"))
    s.add_argument("path")
    s.add_argument("--json", action="store_true", help="print the raw manifest (of a "
                                                        "fast-tier step: one rank's view)")
    s.add_argument("--rank", type=int, help="a fast-tier step: the rank whose view is shown "
                                            "(default the lowest here)")
    s.set_defaults(fn=cmd_inspect)
    s = sub.add_parser("du", help="bytes each checkpoint under ROOT owns and references "
                                  "(incremental), and the total on disk",
                       description="Bytes each checkpoint under ROOT owns and references in "
                       "its siblings (incremental saves), and the total on disk (each file "
                       "once). A fast-tier step owns its ranks' files on this node; the "
                       "replicas in its peers/step-<N>/ are listed and counted too. "
                       + FAST_TIER)
    s.add_argument("root")
    s.set_defaults(fn=cmd_du)
    s = sub.add_parser("verify", help="check every checksum; exit 1 listing failures",
                       description="Read every byte of a checkpoint and check its checksums; "
                       "exit 1 listing each failure (file, byte range, tensor region). PATH "
                       "may be a fast-tier step (local_root/step-<N>): what this node holds "
                       "is checked (each rank's view and its files). "
                       + FAST_TIER.replace("ROOT", "Its parent"))
    s.add_argument("path")
    s.set_defaults(fn=cmd_verify)
    s = sub.add_parser("gc", help="remove leftovers of failed saves under ROOT (on S3 also "
                                  "abort their incomplete multipart uploads)")
    s.add_argument("root", help="a root of checkpoints or one checkpoint directory: files "
                                "that any manifest beside it still references are kept. A "
                                "fast tier's local_root is refused: its manager cleans it")
    s.add_argument("--dry-run", action="store_true", help="list, remove nothing")
    s.add_argument("--min-age", type=float, default=3600.0, metavar="SECONDS",
                   help="only files older than this (default 3600); the files of a save "
                        "in progress (a live intent) are kept whatever this says")
    s.set_defaults(fn=cmd_gc)
    s = sub.add_parser("export", help="write a checkpoint's tensors as Hugging Face "
                                      "safetensors (model.safetensors or shards + index)")
    s.add_argument("ckpt")
    s.add_argument("out_dir")
    s.add_argument("--prefix", help="export the keys under PREFIX, without it in the names "
                                     "(e.g. train.model. for TrainingState under 'train')")
    s.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="convert floating-point tensors (others are written as saved)")
    s.add_argument("--max-shard-size", default="5GB", help="largest output file (default 5GB)")
    s.add_argument("--overwrite", action="store_true",
                   help="replace the weights in a non-empty OUT_DIR (other files are kept)")
    s.add_argument("--ranks", type=int, default=None,
                   help="export from N local processes, each writing a balanced share of "
                        "whole tensors, the index last (under torchrun: each process its "
                        "share, from RANK and WORLD_SIZE)")
    s.set_defaults(fn=cmd_export)
    s = sub.add_parser("import", help="make a dckpt checkpoint from a DCP directory, HF "
                                      "safetensors or a torch.save file. DCP's .metadata is "
                                      "a pickle: import only checkpoints you trust",
                           description="Make a dckpt checkpoint from a torch.distributed."
                           "checkpoint (DCP) directory, Hugging Face safetensors (a file, or a "
                           "directory with or without model.safetensors.index.json) or a "
                           "torch.save file (read with weights_only=True). WARNING: DCP's "
                           ".metadata is a pickle. dckpt reads it with a restricted unpickler, "
                           "but the import trusts its source: import only checkpoints you "
                           "trust. The new checkpoint itself is pickle-free. See "
                           "docs/INTEROP.md.")
    s.add_argument("src", help="local DCP directory, .safetensors file or directory, or "
                               "torch.save file")
    s.add_argument("dst", help="the new checkpoint (path or fsspec URL)")
    s.add_argument("--format", choices=["auto", "dcp", "safetensors", "torch", "deepspeed"],
                   default="auto", help="deepspeed: a stock DeepSpeed ZeRO tag folder "
                   "(global_step<N>), imported as a dckpt DeepSpeed tag (auto detects it)")
    s.add_argument("--prefix", help="put every key under PREFIX (e.g. train.model. so that "
                                     "TrainingState under 'train' loads the weights)")
    s.add_argument("--alias", action="append", metavar="NEW=EXISTING",
                   help="also store tensor EXISTING as NEW (tied weights: "
                        "lm_head.weight=model.embed_tokens.weight); repeatable")
    s.add_argument("--max-shard-size", default="1GB",
                   help="largest data file, and about the memory used (default 1GB)")
    s.add_argument("--compression", choices=["zstd", "lz4"])
    s.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    s.set_defaults(fn=cmd_import)
    s = sub.add_parser("history", help="recent saves a CheckpointManager recorded under ROOT "
                                       "(time, size, blocking and total seconds, throughput)")
    s.add_argument("root")
    s.add_argument("--last", type=int, metavar="N",
                   help="only the last N saves (default 20 in the table; every save with "
                        "--json or --plot); 0: all")
    s.add_argument("--tier", choices=["all", "durable", "local"], default="all",
                   help="only the saves of one tier (default all)")
    s.add_argument("--json", action="store_true", help="print the records as a JSON array")
    s.add_argument("--plot", metavar="FILE.png",
                   help="also draw blocking time, total time and size per step to FILE "
                        "(needs matplotlib: pip install 'dckpt[plot]')")
    s.set_defaults(fn=cmd_history)
    from .diff import add_parser as add_diff

    add_diff(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        rc = args.fn(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return rc
    except BrokenPipeError:
        return _closed_pipe()
    except Exception as e:  # one line and exit 2 whatever failed; the traceback under -v
        if args.verbose:
            traceback.print_exc()
        print(f"dckpt {args.cmd}: {_message(e, args.verbose)}", file=sys.stderr)
        return 2


def _closed_pipe() -> int:
    """The reader of stdout went away (``dckpt inspect ... | head``): end quietly, as
    Unix tools do, with the status a SIGPIPE death gives (128 + 13). Python's own
    recipe: stdout now points at /dev/null, so the interpreter's final flush of what
    is still buffered cannot fail again and print a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (a test's capture)
        pass
    return 141


# Errors whose message says it all: ours, the file system's, an unknown fsspec protocol
# or bad storage options (ValueError), a protocol whose package is missing (ImportError).
_EXPECTED = (CheckpointError, OSError, ValueError, ImportError)


def _message(e: Exception, verbose: bool) -> str:
    msg = str(e) or type(e).__name__
    if not isinstance(e, _EXPECTED):  # likely a bug: say what it was and how to see more
        msg = f"{type(e).__name__}: {msg}" + ("" if verbose else " (-v shows the traceback)")
    return " ".join(msg.split())  # one line, even for a multi-line message


if __name__ == "__main__":
    sys.exit(main())
