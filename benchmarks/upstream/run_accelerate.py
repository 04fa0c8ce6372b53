"""Run Accelerate's own checkpoint tests twice: stock, and with ``DckptAccelerator`` swapped
in for ``accelerate.Accelerator`` (issue 51). Prints, per test, the stock result, the
dckpt result and, for each failure only dckpt has, whether it is an allowed exception
(the test asserts a stock file name; ``accelerate_exceptions.py``) or a defect. Exits 1
when a dckpt-only failure is not an allowed exception (or the swap did not reach a test).

What it runs, from the source distribution of the installed accelerate version
(``pip download --no-deps --no-binary :all: accelerate==VER`` into ``--cache``, which is
not committed; the tests are extracted there and never copied into the project):

- ``tests/test_state_checkpointing.py``: every test;
- ``tests/test_accelerator.py``: its save/load/checkpoint tests, by
  ``-k "save or pickle or from_offload"``: ``test_save_load_model_*``,
  ``test_save_load_model_with_hooks_*``, ``test_save_model_*`` (incl.
  ``test_save_model_with_stateful_dataloader_*`` and ``test_save_model_offload_*``),
  ``test_save_sharded_model_*``, ``test_get_state_dict_from_offload_*`` and
  ``test_can_pickle_dataloader_*`` (pickles the accelerator, as dataloader workers do).

The swap is the pytest plugin ``dckpt_swap.py`` (this folder): it rebinds
``accelerate.Accelerator``, ``accelerate.accelerator.Accelerator`` and the test modules'
own ``Accelerator`` names at import time, and counts the accelerators each test builds.
Tests marked ``require_non_cpu`` skip on a CPU-only machine; ``test_map_location`` runs
its file under ``accelerate launch`` in a subprocess, which the swap does not reach
(reported as "not reached" when it runs).

    python benchmarks/upstream/run_accelerate.py                 # both passes, -n 2
    python benchmarks/upstream/run_accelerate.py --json out.json --workers 1
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from accelerate_exceptions import EXCEPTIONS, allowed  # noqa: E402

FILES = ("tests/test_state_checkpointing.py", "tests/test_accelerator.py")
SELECT = "test_state_checkpointing or save or pickle or from_offload"


def fetch(version: str, cache: Path) -> Path:
    """The sdist's tarball in ``cache`` (downloaded once with pip)."""
    cache.mkdir(parents=True, exist_ok=True)
    tgz = cache / f"accelerate-{version}.tar.gz"
    if not tgz.exists():
        print(f"downloading accelerate=={version} sdist into {cache}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"accelerate=={version}", "-d", str(cache), "-q"], check=True)
    if not tgz.exists():
        raise SystemExit(f"pip download did not produce {tgz}")
    return tgz


def extract(tgz: Path, version: str, cache: Path) -> Path:
    """Extract the test files (and any test helper module they import from the sdist's
    tests/) under ``cache/accelerate-VER/``; return its tests folder."""
    top = f"accelerate-{version}"
    dest = cache / top
    with tarfile.open(tgz) as tf:
        names = set(tf.getnames())
        helpers = {Path(n).stem: n for n in names
                   if n.startswith(f"{top}/tests/") and n.endswith(".py") and n.count("/") == 2}
        todo = [f"{top}/{f}" for f in FILES]
        done: set[str] = set()
        while todo:
            n = todo.pop()
            if n in done:
                continue
            if n not in names:
                raise SystemExit(f"{n} is not in {tgz.name}")
            done.add(n)
            src = tf.extractfile(n).read()
            for node in ast.walk(ast.parse(src)):  # helpers imported from tests/
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                        [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                for m in mods:
                    parts = m.split(".")
                    head = parts[1] if parts[0] == "tests" and len(parts) > 1 else parts[0]
                    if head in helpers and helpers[head] not in done:
                        todo.append(helpers[head])
            out = cache / n
            out.parent.mkdir(parents=True, exist_ok=True)
            if not out.exists() or out.read_bytes() != src:
                out.write_bytes(src)
    # an empty config: neither the sdist's nor dckpt's pytest settings apply
    (dest / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    order: pytest-order's marker (accelerate's run_first)\n")
    return dest / "tests"


def run_pass(tests: Path, swap: bool, workers: int, select: str, timeout: int,
             logs: Path) -> dict:
    name = "dckpt" if swap else "stock"
    out = logs / f"{name}.json"
    log = logs / f"{name}.log"
    out.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["DCKPT_UPSTREAM_SWAP"] = "1" if swap else "0"
    env["DCKPT_UPSTREAM_RESULTS"] = str(out)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "pytest", "-c", str(tests.parent / "pytest.ini"),
           "--rootdir", str(tests.parent), "-p", "no:cacheprovider", "-p", "dckpt_swap",
           "-q", "--tb=short", "-k", select, *(["-n", str(workers)] if workers > 1 else []),
           *[Path(f).name for f in FILES]]
    print(f"[{name}] {' '.join(cmd[2:])}  (log: {log})", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=tests, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    took = time.monotonic() - t0
    tail = log.read_text().strip().splitlines()
    print(f"[{name}] {tail[-1] if tail else ''}  ({took:.0f} s, rc {rc})", flush=True)
    if not out.exists():
        raise SystemExit(f"[{name}] pytest wrote no results (rc {rc}); see {log}")
    res = json.loads(out.read_text())
    res["rc"], res["seconds"] = rc, round(took, 1)
    return res


def short(nodeid: str) -> str:
    """``file::Class::test`` without the ``test_`` prefixes and the common class name."""
    parts = nodeid.split("::")
    parts[0] = Path(parts[0]).stem.removeprefix("test_")
    parts = [p for p in parts if p not in ("AcceleratorTester",)]
    return "::".join(p.replace("CheckpointTest_", "") for p in parts)


def _loc(f: dict) -> str:
    p = f["path"]
    try:
        p = str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        p = Path(p).name
    code = next((x.strip()[1:].strip() for x in f.get("lines", [])
                 if x.lstrip().startswith(">")), "")
    if not code:  # --tb=short: the frame's source line is the entry's first line
        code = next((x.strip() for x in f.get("lines", []) if x.strip()), "")
    return f"{p}:{f['lineno']}" + (f"  {code}" if code else "")


def key_frames(r: dict) -> dict:
    """A failure's key lines: the message (outermost, and the root cause when chained),
    the deepest dckpt frame (of the root cause when it has one) and the test's lines
    (its own body, and the deepest test-file frame when that is a helper)."""
    chain = r.get("chain") or []
    links = [c["frames"] for c in chain] or [r.get("frames") or []]
    is_dckpt = lambda f: "/dckpt/" in f["path"].replace(os.sep, "/")  # noqa: E731
    names = {Path(x).name for x in FILES}
    dck = next((list(filter(is_dckpt, fr)) for fr in links if any(map(is_dckpt, fr))), [])
    tst = [f for f in links[-1] if Path(f["path"]).name in names]
    msg = (r.get("message") or "").strip()
    root = (chain[0].get("message") or "").strip() if len(chain) > 1 else ""
    last = (links[-1] or [{}])[-1]
    detail = [x[1:].strip() for x in last.get("lines", []) if x.startswith("E")][1:8]
    return {"message": msg, "root_cause": root if root and root != msg else None,
            "detail": [d for d in detail if d],
            "dckpt_frame": _loc(dck[-1]) if dck else None,
            "test_line": " -> ".join(dict.fromkeys(_loc(f) for f in (tst[:1] + tst[-1:])))
            if tst else None}


def group_key(message: str) -> str:
    m = (message or "").splitlines()[0] if message else ""
    m = re.sub(r"(/tmp|/var)[^\s'\"]*", "<tmp>", m)
    m = re.sub(r"0x[0-9a-f]+", "0x…", m)
    m = re.sub(r"\b\d+\.\d+(e-?\d+)?\b", "<num>", m)
    return m[:200]


def classify(stock: dict, dckpt: dict) -> list[dict]:
    rows = []
    for nodeid in sorted(set(stock["tests"]) | set(dckpt["tests"])):
        s = stock["tests"].get(nodeid, {"outcome": "absent"})
        d = dckpt["tests"].get(nodeid, {"outcome": "absent"})
        row = {"test": nodeid, "stock": s["outcome"], "dckpt": d["outcome"], "verdict": "",
               "built_stock": s.get("accelerators_built", ""),
               "built_dckpt": d.get("accelerators_built", "")}
        built_d = dict(x.split(":") for x in row["built_dckpt"].split(",") if x)
        built_s = dict(x.split(":") for x in row["built_stock"].split(",") if x)
        if int(built_d.get("Accelerator", 0)):
            row["verdict"] = "LEAK: a stock Accelerator was built in the swapped run"
        elif d["outcome"] in ("passed", "failed", "error") and int(built_s.get("Accelerator", 0)) \
                and not int(built_d.get("DckptAccelerator", 0)):
            row["verdict"] = "not reached: no DckptAccelerator built in this process"
        if d["outcome"] in ("failed", "error"):
            row.update(key_frames(d))
        if s["outcome"] == "passed" and d["outcome"] in ("failed", "error", "absent"):
            text = json.dumps(d)
            e = allowed(nodeid, text)
            row["dckpt_only"] = True
            if e:
                row["verdict"] = row["verdict"] or f"allowed: asserts {', '.join(e['files'])}"
                row["why"] = e["why"]
            else:
                row["verdict"] = row["verdict"] or "DEFECT"
                row["group"] = group_key(row.get("message", "")) + (
                    f"  <- caused by: {group_key(row['root_cause'])}" if row.get("root_cause") else "")
        elif s["outcome"] in ("failed", "error"):
            row["verdict"] = row["verdict"] or "fails stock too"
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    w = max(len(short(r["test"])) for r in rows)
    out = [f"{'test':<{w}}  {'stock':<7}  {'dckpt':<7}  verdict", "-" * (w + 30)]
    for r in rows:
        out.append(f"{short(r['test']):<{w}}  {r['stock']:<7}  {r['dckpt']:<7}  {r['verdict']}")
    return "\n".join(out)


def main() -> int:
    import accelerate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default=accelerate.__version__,
                    help="accelerate sdist version (default: the installed one, %(default)s)")
    ap.add_argument("--cache", type=Path, default=HERE / ".cache",
                    help="download/extract folder, not committed (default: %(default)s)")
    ap.add_argument("--workers", "-n", type=int, default=2, help="xdist workers (1: none)")
    ap.add_argument("-k", dest="select", default=SELECT, help="pytest -k (default: %(default)r)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per pass")
    ap.add_argument("--json", type=Path, help="write every result here")
    a = ap.parse_args()

    if a.version != accelerate.__version__:
        print(f"warning: running accelerate {a.version}'s tests against the installed "
              f"accelerate {accelerate.__version__}", file=sys.stderr)
    try:
        import parameterized  # noqa: F401  (the upstream tests import it)
    except ImportError:
        raise SystemExit("the upstream tests need `parameterized`: pip install parameterized")
    if a.workers > 1:
        try:
            import xdist  # noqa: F401
        except ImportError:
            a.workers = 1

    tests = extract(fetch(a.version, a.cache), a.version, a.cache)
    logs = a.cache / "logs"
    logs.mkdir(exist_ok=True)
    stock = run_pass(tests, False, a.workers, a.select, a.timeout, logs)
    dckpt = run_pass(tests, True, a.workers, a.select, a.timeout, logs)
    rows = classify(stock, dckpt)

    print()
    print(table(rows))
    n = lambda res, o: sum(1 for t in res["tests"].values() if t["outcome"] == o)  # noqa: E731
    print(f"\nstock: {n(stock, 'passed')} passed, {n(stock, 'failed') + n(stock, 'error')} failed, "
          f"{n(stock, 'skipped')} skipped | dckpt: {n(dckpt, 'passed')} passed, "
          f"{n(dckpt, 'failed') + n(dckpt, 'error')} failed, {n(dckpt, 'skipped')} skipped")
    only = [r for r in rows if r.get("dckpt_only")]
    bad = [r for r in only if r["verdict"] == "DEFECT"]
    leaks = [r for r in rows if r["verdict"].startswith(("LEAK", "not reached"))]
    print(f"dckpt-only failures: {len(only)} ({len(only) - len(bad)} allowed file-name "
          f"exceptions, {len(bad)} defects); exceptions listed: {len(EXCEPTIONS)}")

    if bad:
        print("\ndckpt-only failures by cause (crash message; deepest dckpt frame; test line):")
        groups: dict[str, list[dict]] = {}
        for r in bad:
            groups.setdefault(r["group"], []).append(r)
        for g, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            print(f"\n  [{len(rs)}] {g}")
            frames = sorted({r.get("dckpt_frame") for r in rs if r.get("dckpt_frame")})
            for f in frames:
                print(f"      dckpt: {f}")
            for d in rs[0].get("detail") or []:
                print(f"      | {d[:150]}")
            lines = sorted({r.get("test_line") for r in rs if r.get("test_line")})
            for t in lines:
                print(f"      test:  {t}")
            for r in rs:
                print(f"      - {short(r['test'])}")
    for r in leaks:
        print(f"\n{short(r['test'])}: {r['verdict']}")

    if a.json:
        a.json.write_text(json.dumps({
            "accelerate": a.version, "select": a.select, "files": FILES,
            "exceptions": EXCEPTIONS,
            "stock": {k: stock[k] for k in ("rc", "seconds")},
            "dckpt": {k: dckpt[k] for k in ("rc", "seconds")},
            "rows": rows}, indent=1))
        print(f"\nwrote {a.json}")
    if not stock["tests"] or not any(t["outcome"] == "passed" for t in stock["tests"].values()):
        print("no stock test passed: the setup is broken", file=sys.stderr)
        return 2
    return 1 if bad or any(r["verdict"].startswith("LEAK") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
