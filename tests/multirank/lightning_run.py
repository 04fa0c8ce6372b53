"""Running a Lightning/Fabric job script (tests/multirank/jobs/) as a real process group:
Lightning's launcher re-executes the script once per extra device, every rank a child of
rank 0 in one session, reaped whole whatever happens."""
from __future__ import annotations

import os
import signal
import subprocess
import sys


def run_job(script: str, root: str, strategy: str, devices: int, *args: str,
            timeout: float = 240, killed: bool = False, failed: bool = False,
            any_status: bool = False) -> str:
    """Run ``script --strategy S --devices N --root R ARGS`` under a deadline; return its
    output. It must exit 0, or with ``killed``, end by SIGKILL, or with ``failed``, exit
    with an error status; with ``any_status``, however it ends (not by the deadline)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("DCKPT_FAULT", None)
    proc = subprocess.Popen([sys.executable, script, "--strategy", strategy, "--devices",
                             str(devices), "--root", root, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"job timed out after {timeout} s:\n{out[-4000:]}")
    finally:
        try:  # Lightning's other ranks are children of rank 0: none may outlive it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if any_status:
        pass
    elif killed:
        assert proc.returncode == -signal.SIGKILL, out[-4000:]
    elif failed:
        assert proc.returncode not in (0, -signal.SIGKILL), out[-4000:]
    else:
        assert proc.returncode == 0, out[-4000:]
    return out
