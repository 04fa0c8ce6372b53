"""Running a job script (tests/multirank/jobs/) as a real process group under a deadline:
Lightning's launcher re-executes its script once per extra device, every rank a child of
rank 0 in one session; torchrun jobs likewise run in one session. Reaped whole whatever
happens."""
from __future__ import annotations

import os
import signal
import subprocess
import sys


def job_env() -> dict:
    """The environment a job runs in: one thread per process, unbuffered output, no
    fault armed from the test's own environment."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("DCKPT_FAULT", None)
    return env


def run_cmd(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run ``cmd`` in its own session under a deadline; return (exit status, output).
    Past the deadline the whole session is SIGKILLed and an AssertionError raised; after
    it ends, anything it left running (children of rank 0) is killed too."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or job_env(), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"job timed out after {timeout} s:\n{out[-4000:]}")
    finally:
        try:  # a job's other ranks are children of rank 0: none may outlive it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, out


def _errors(out: str, most: int = 80) -> str:
    """The lines of a job's output that say what failed (tracebacks' last lines,
    errors), rank 0's included: a failure's cause, whatever the tail shows."""
    keep = [ln for ln in out.splitlines()
            if ("Error" in ln or "Traceback" in ln or "raise" in ln or "Exception" in ln
                or ln.startswith("  File "))]
    return "\n".join(keep[:most])


def torchrun(script: str, nproc: int | None) -> list[str]:
    """The command that runs ``script`` under torchrun with ``nproc`` processes (None:
    one plain process, no torchrun)."""
    if nproc is None:
        return [sys.executable, script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", script]


def run_job(script: str, root: str, strategy: str, devices: int, *args: str,
            timeout: float = 240, killed: bool = False, failed: bool = False,
            any_status: bool = False) -> str:
    """Run ``script --strategy S --devices N --root R ARGS`` under a deadline; return its
    output. It must exit 0, or with ``killed``, end by SIGKILL, or with ``failed``, exit
    with an error status; with ``any_status``, however it ends (not by the deadline)."""
    rc, out = run_cmd([sys.executable, script, "--strategy", strategy, "--devices",
                       str(devices), "--root", root, *args], timeout)
    if any_status:
        pass
    elif killed:
        assert rc == -signal.SIGKILL, f"exit status {rc}:\n{_errors(out)}\n...\n{out[-2500:]}"
    elif failed:
        assert rc not in (0, -signal.SIGKILL), f"exit status {rc}:\n{out[-4000:]}"
    else:
        assert rc == 0, f"exit status {rc}:\n{out[-4000:]}"
    return out
