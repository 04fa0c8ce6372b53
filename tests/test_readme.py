"""The README's first example runs as written (issue 27, 10): the single-process quick
start (save, load, `dckpt ls`) in a fresh directory, twice, and the one line it gives to
turn on dckpt's log lines does show them."""
from __future__ import annotations

import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _quick_start() -> tuple[str, str, list[str]]:
    """The first python block of the README (its file name from its first line, a
    ``# name.py`` comment) and the commands of the bash block right after it."""
    text = open(README).read()
    m = re.search(r"```python\n(# (\S+\.py)\n.*?)```\s*```bash\n(.*?)```", text, re.S)
    assert m, "no python block followed by a bash block in README.md"
    return m.group(2), m.group(1), [ln for ln in m.group(3).splitlines() if ln.strip()]


def _run(cmd: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep
           + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
    # `python` and `dckpt` of this interpreter's environment, as after the README's install.
    return subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_single_process_quick_start_runs_as_written(tmp_path):
    name, code, commands = _quick_start()
    assert len([ln for ln in code.splitlines() if not ln.startswith("#")]) <= 6, code
    assert commands == [f"python {name}", "dckpt ls ckpts"], commands
    (tmp_path / name).write_text(code)
    for c in [commands[0], *commands]:  # overwrite=True: a second run works too
        p = _run(c, tmp_path)
        assert p.returncode == 0, (c, p.stdout, p.stderr)
    listing = p.stdout
    assert re.search(r"ckpts/step-10\s+committed", listing), listing
    assert os.path.exists(tmp_path / "ckpts" / "step-10" / "manifest.json")


def test_logging_line_shows_saves_and_loads(tmp_path):
    name, code, _ = _quick_start()
    m = re.search(r"`(logging\.basicConfig\([^`]*\))`", open(README).read())
    assert m, "the README shows no logging.basicConfig line"
    check = ('\nassert torch.equal(restored["weight"], state["weight"]), restored\n'
             'assert restored["step"] == 10\n')
    (tmp_path / name).write_text(f"import logging\n{m.group(1)}\n{code}{check}")
    p = _run(f"python {name}", tmp_path)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert re.search(r"INFO:dckpt\.\S+:saved \S*ckpts/step-10", p.stderr), p.stderr
    assert re.search(r"INFO:dckpt\.\S+:loaded \S*ckpts/step-10", p.stderr), p.stderr


def test_tested_torch_version_is_the_one_ci_installs():
    """The README states the torch version that is tested (issue 27, 11): it must be the
    one .ci/run pins, and pyproject.toml's comment must say the same."""
    root = os.path.join(os.path.dirname(__file__), "..")
    said = re.search(r"Tested with torch (\d+\.\d+\.\d+)", open(README).read())
    pinned = re.search(r"torch==(\d+\.\d+\.\d+)", open(os.path.join(root, ".ci", "run")).read())
    assert said and pinned and said.group(1) == pinned.group(1), (said, pinned)
    py = open(os.path.join(root, "pyproject.toml")).read()
    assert f"Tested with torch {pinned.group(1)} only" in py
