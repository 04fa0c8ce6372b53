"""pytest plugin for ``run_accelerate.py``: runs Accelerate's own tests with
``DckptAccelerator`` in place of ``accelerate.Accelerator`` and records every result.

Loaded with ``-p dckpt_swap`` (this folder on PYTHONPATH). Environment:

- ``DCKPT_UPSTREAM_SWAP=1``: at ``pytest_configure`` (before any test module is
  imported) ``accelerate.Accelerator`` and ``accelerate.accelerator.Accelerator`` become
  ``DckptAccelerator``; right after each test module is imported every module-level name
  bound to the stock class (``from accelerate import Accelerator``, under any alias) is
  rebound to it too. The test files are never modified.
- ``DCKPT_UPSTREAM_RESULTS=PATH``: the controlling process (not an xdist worker) writes
  one JSON record per test there at the end of the session.

In both modes every ``Accelerator`` construction is counted per test by class name
(``Accelerator``/``DckptAccelerator``), so the runner can prove the swap reached each test:
a stock ``Accelerator`` built in the swapped run is a leak. Processes the tests start
(``accelerate launch``) are not reached; the runner marks such tests.
"""
from __future__ import annotations

import functools
import json
import os

import pytest

SWAP = os.environ.get("DCKPT_UPSTREAM_SWAP") == "1"
RESULTS = os.environ.get("DCKPT_UPSTREAM_RESULTS")

_stock = None       # accelerate's own class
_replacement = None  # DckptAccelerator when swapping
_built: dict[str, int] = {}
_records: dict[str, dict] = {}


def _count_constructions(cls) -> None:
    init = cls.__init__

    @functools.wraps(init)
    def counted(self, *args, **kwargs):
        name = type(self).__name__
        _built[name] = _built.get(name, 0) + 1
        return init(self, *args, **kwargs)

    cls.__init__ = counted


def pytest_configure(config):
    global _stock, _replacement
    config.addinivalue_line("markers", "order(n): pytest-order's marker (accelerate's run_first)")
    import accelerate
    import accelerate.accelerator

    _stock = accelerate.accelerator.Accelerator
    _count_constructions(_stock)  # DckptAccelerator's super().__init__ is counted too
    if SWAP:
        from dckpt.integrations.accelerate import DckptAccelerator

        assert issubclass(DckptAccelerator, _stock)
        _replacement = DckptAccelerator
        accelerate.Accelerator = DckptAccelerator
        accelerate.accelerator.Accelerator = DckptAccelerator


def _rebind(module) -> list[str]:
    names = [k for k, v in vars(module).items() if v is _stock]
    for k in names:
        setattr(module, k, _replacement)
    return names


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    if SWAP and isinstance(collector, pytest.Module):
        mod = getattr(collector, "_obj", None)  # imported by this collection step
        if mod is not None:
            _rebind(mod)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _built.clear()
    if SWAP:
        _rebind(item.module)  # a no-op unless something rebound it since import


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if call.when == "teardown" or rep.failed:
        built = ",".join(f"{k}:{v}" for k, v in sorted(_built.items()))
        rep.user_properties.append(("accelerators_built", built))


def _entries(longrepr):
    tb = getattr(longrepr, "reprtraceback", None)
    out = []
    for e in getattr(tb, "reprentries", None) or []:
        loc = getattr(e, "reprfileloc", None)
        if loc is not None:
            out.append({"path": str(loc.path), "lineno": loc.lineno, "message": loc.message,
                        "lines": [str(x) for x in getattr(e, "lines", [])]})
    return out


def pytest_runtest_logreport(report):
    r = _records.setdefault(report.nodeid, {"outcome": "passed", "when": None,
                                            "message": None, "location": None,
                                            "frames": [], "accelerators_built": ""})
    for k, v in report.user_properties:
        if k == "accelerators_built" and v:
            r["accelerators_built"] = v
    if report.skipped and r["outcome"] == "passed":
        r["outcome"] = "skipped"
        lr = report.longrepr
        r["message"] = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    elif report.failed and r["outcome"] in ("passed", "skipped"):
        r["outcome"] = "failed" if report.when == "call" else "error"
        r["when"] = report.when
        lr = report.longrepr
        crash = getattr(lr, "reprcrash", None)
        if crash is not None:
            r["message"] = crash.message
            r["location"] = f"{crash.path}:{crash.lineno}"
        else:
            r["message"] = str(lr).strip().splitlines()[-1] if str(lr).strip() else ""
        r["frames"] = _entries(lr)
        # a chained exception (``raise X from cause``): every link, the root cause first
        r["chain"] = [{"message": getattr(c, "message", None),
                       "location": f"{c.path}:{c.lineno}" if c is not None else None,
                       "frames": _entries(type("R", (), {"reprtraceback": tb})())}
                      for tb, c, _descr in getattr(lr, "chain", None) or []]


def pytest_sessionfinish(session, exitstatus):
    if RESULTS and not hasattr(session.config, "workerinput"):
        with open(RESULTS, "w") as f:
            json.dump({"swap": SWAP, "exitstatus": int(exitstatus), "tests": _records}, f,
                      indent=1)
