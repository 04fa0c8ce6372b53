"""Elastic training end to end on one CPU machine, narrated and checked.

    python launch/elastic_demo.py --workdir /tmp/demo

1. torchrun runs launch/train.py on 4 ranks (--max-restarts=2) with a checkpoint every
   4 steps; once one has committed, a worker is SIGKILLed mid-run; torchrun restarts the
   workers and they resume from the last committed step.
2. The finished job is run again on 2 ranks with more steps: the 4-rank checkpoint is
   resharded, and the data sampler continues with the next unseen samples.
3. Two torchrun agents on loopback form one job (--nnodes=1:2, c10d rendezvous). One
   agent is SIGKILLed with its workers after checkpoints exist; the survivor
   re-rendezvouses alone and finishes from the last checkpoint, which then verifies.
4. The replicated fast tier: two agents (--nnodes=2:2), each one node (--node-id A, B)
   with its own --local-root, --replicas 1, and fast-tier saves that never go durable.
   Once steps are replicated, agent B is SIGKILLed with its workers and its local_root
   wiped, as a lost machine; A's workers fail on the lost peer. Both agents start
   again: B's part of the newest replicated step exists only as A's replica, and the
   job resumes from it "from the peer tier" and finishes.

Each phase checks what it shows and the script exits 1 with the reason on the first
expectation that fails. Full logs are written under --workdir. The process helpers
(Agent, free_port, rdzv_args, ...) are shared with tests/multirank/test_elastic.py.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "train.py")
BATCH = 8  # train.py's default --batch: samples per rank and step

# Rendezvous settings for a quick demo on loopback (seconds). A restarted agent waits
# last_call for latecomers; a dead agent is dropped from the rendezvous after
# keep_alive_interval * keep_alive_max_attempt without a heartbeat (default 5 * 3).
RDZV_CONF = ("join_timeout=60,last_call_timeout=2,close_timeout=5,"
             "keep_alive_interval=1,keep_alive_max_attempt=3")

# Lines echoed while narrating (everything goes to the log files).
ECHO = re.compile(r"train: (world|data|step \d*0 )|saved \S+|final step|will restart|"
                  r"new nodes|Error|error:|re-created")


class DemoError(Exception):
    """An expectation of the demo failed; the message says which."""


def free_port() -> int:
    """A TCP port free right now on loopback (another process may take it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def standalone_args(nproc: int, restarts: int) -> list[str]:
    """torchrun options of a single-agent job."""
    return ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}"]


def rdzv_args(port: int, run_id: str, nproc: int, restarts: int, *, host: bool,
              nnodes: str = "1:2") -> list[str]:
    """torchrun options of one agent of a multi-agent job on loopback. The agent with
    ``host`` hosts the c10d rendezvous store on ``port`` (and fails if the port is
    taken); the others connect to it, retrying until it is up, so all may be started
    at once. (Left to itself, torchrun makes whichever agent binds the port first the
    host.)"""
    conf = f"{RDZV_CONF},is_host={str(host).lower()}"
    return [f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
            f"--rdzv-conf={conf}", "--monitor-interval=0.2"]


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> dict[int, int]:
    """Every live descendant of ``pid`` with its start time, from /proc (Linux): torchrun
    starts its workers in sessions of their own, so a process group kill misses them.
    O(processes on the machine)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            children.setdefault(st[0], []).append((int(d), st[1]))
    out, todo = {}, [pid]
    while todo:
        for child, start in children.get(todo.pop(), []):
            out[child] = start
            todo.append(child)
    return out


def _kill(pids: dict[int, int | None], sig: int = signal.SIGKILL) -> None:
    """Signal each pid whose start time is still the one given (None: any), so a pid
    that the system has reused since is left alone."""
    for pid, start in pids.items():
        st = _stat(pid)
        if st is not None and (start is None or st[1] == start):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


class Agent:
    """One torchrun agent running launch/train.py, in a session of its own, its output
    collected line by line (and copied to ``log_path`` and, for lines matching ECHO,
    printed as ``[name] line`` when ``echo``). Use as a context manager, or call
    :meth:`close`: either kills whatever is left of the agent and its workers."""

    def __init__(self, name: str, launcher: list[str], train_args: list[str], *,
                 echo: bool = False, log_path: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.echo = name, echo
        e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
             "LOGLEVEL": "INFO", **(env or {})}  # LOGLEVEL: the agent logs its restarts
        self.lines: list[str] = []
        self._log = open(log_path, "w") if log_path else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *launcher, TRAIN, *train_args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e,
            start_new_session=True)
        self._workers: dict[int, int] = {}  # every worker seen: pid -> start time
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self._log:
                self._log.write(line)
                self._log.flush()
            if self.echo and ECHO.search(line):
                print(f"    [{self.name}] {line.rstrip()[:160]}", flush=True)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        return wait_for([self], pattern, timeout)

    def worker_pids(self) -> list[int]:
        """The agent's live descendants (its ranks), ascending; remembered for
        :meth:`close`."""
        found = descendants(self.proc.pid)
        self._workers.update(found)
        return sorted(found)

    def kill(self) -> list[int]:
        """SIGKILL the agent and every worker of it, as a lost machine would; returns
        the workers' pids. The agent is stopped first so it cannot start a worker
        between the listing and the kill."""
        _kill({self.proc.pid: None}, signal.SIGSTOP)
        workers = descendants(self.proc.pid)
        self._workers.update(workers)
        _kill({self.proc.pid: None, **workers})
        self.proc.wait()
        return sorted(workers)

    def finish(self, timeout: float = 150) -> int:
        """Wait for the agent to exit; its exit status. Raises DemoError after
        ``timeout``. Kills whatever is left either way."""
        try:
            self.worker_pids()
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DemoError(f"agent {self.name} still running after {timeout:.0f} s:\n"
                            f"{self.text[-3000:]}") from None
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        _kill(self._workers)  # orphans of an agent that died or was killed
        self._reader.join(timeout=5)  # EOF once no worker holds the pipe
        if self._log and not self._reader.is_alive():
            self._log.close()
            self._log = None

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_for(agents: list[Agent], pattern: str, timeout: float = 120) -> re.Match:
    """Block until ``pattern`` appears in the output of one of ``agents``; its match.
    Raises DemoError when all of them have exited without it, or after ``timeout``.
    Polls every 50 ms; every 0.5 s also notes the agents' workers (to kill them later,
    should their agent die), a scan of /proc that costs a few ms."""
    rx = re.compile(pattern)
    end = time.monotonic() + timeout
    polls = 0
    while True:
        for a in agents:
            if polls % 10 == 0:
                a.worker_pids()
            m = rx.search(a.text)
            if m:
                return m
        if all(a.proc.poll() is not None for a in agents):
            time.sleep(0.5)  # the reader may still hold the last lines
            for a in agents:
                if m := rx.search(a.text):
                    return m
            break
        if time.monotonic() > end:
            break
        time.sleep(0.05)
        polls += 1
    tails = "\n".join(f"--- {a.name} (exit {a.proc.poll()}):\n{a.text[-2500:]}" for a in agents)
    raise DemoError(f"never saw {pattern!r}:\n{tails}")


def saved_steps(text: str) -> list[int]:
    """Steps whose checkpoint commit rank 0 logged, in order."""
    return [int(s) for s in re.findall(r"saved \S+step-(\d+)", text)]


def starts(text: str) -> list[tuple[int, int, int]]:
    """(world size, step resumed from or 0, data position) of every start of the
    workers that rank 0 logged in ``text`` (train.py --data sampler), in order."""
    # Lazy gap: other ranks' output may come between rank 0's two lines.
    rx = re.compile(r"world (\d+), \w+; (?:starting fresh|resumed from step (\d+))"
                    r"[\s\S]*?data position (\d+) ")
    return [(int(w), int(s or 0), int(p)) for w, s, p in rx.findall(text)]


def position_at(agents: list[Agent], world: int, step: int) -> int:
    """Global data position after ``step``, for a job whose last start at ``world``
    ranks is logged by one of ``agents`` and which ran at that size since: the position
    it started from plus ``world * batch`` per step. Raises DemoError without one."""
    found = [r for a in agents for r in starts(a.text) if r[0] == world]
    if not found:
        raise DemoError(f"no start at world {world} in the logs")
    _, first, pos = found[-1]
    return pos + (step - first) * world * BATCH


def durable_steps(root: str) -> list[int]:
    """The steps committed under a durable root (those with a manifest), ascending."""
    out = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        m = re.fullmatch(r"step-(\d+)", name)
        if m and any(f.startswith("manifest") for f in os.listdir(os.path.join(root, name))):
            out.append(int(m.group(1)))
    return out


# Phase 4 and tests/multirank/test_peer_torchrun.py: fast-tier saves every 2 steps, none
# of them durable but the last (--durable-every far away), each replicated to the other
# node; rank 0 logs each replication.
PEER_ARGS = ["--every", "2", "--durable-every", "1000", "--keep-last-local", "1",
             "--replicas", "1", "--width", "32", "--depth", "1", "--log-every", "1"]
REPLICATED = r"step (\d+) replicated to 1 peer node"


def peer_agents(base: str, tag: str, steps: int, nproc: int, restarts: int,
                step_sleep: float, echo: bool = False) -> tuple[Agent, Agent]:
    """Agents A (the c10d rendezvous host) and B of one job, --nnodes=2:2 (a restart
    needs both), each one node: ``--node-id A``/``B``, local_root ``base``/A or /B, the
    durable root ``base``/durable. A fresh rendezvous (port, run id) per call; logs in
    ``base``/``tag``-A.log and -B.log."""
    port, run_id = free_port(), f"peer-{os.getpid()}-{tag}"
    out = []
    for name in "AB":
        args = ["--steps", str(steps), *PEER_ARGS, "--ckpt-root", os.path.join(base, "durable"),
                "--node-id", name, "--local-root", os.path.join(base, name),
                "--step-sleep", str(step_sleep)]
        launcher = rdzv_args(port, run_id, nproc, restarts, host=name == "A", nnodes="2:2")
        out.append(Agent(name, launcher, args, echo=echo,
                         log_path=os.path.join(base, f"{tag}-{name}.log")))
    return out[0], out[1]


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise DemoError(what)
    print(f"    ok: {what}", flush=True)


# ---------------------------------------------------------------------------- the demo
TRAIN_ARGS = ["--every", "4", "--log-every", "1", "--step-sleep", "0.2", "--data", "sampler"]


def phase_restart(workdir: str) -> str:
    root = os.path.join(workdir, "ckpt-restart")
    print("\n==> 1. torchrun, 4 ranks, --max-restarts=2; a worker is SIGKILLed mid-run")
    args = ["--steps", "24", "--ckpt-root", root, *TRAIN_ARGS]
    log = os.path.join(workdir, "1-restart.log")
    with Agent("4 ranks", standalone_args(4, 2), args, echo=True, log_path=log) as a:
        a.wait_for(r"saved \S+step-00000008")
        victim = a.worker_pids()[-1]
        print(f"    ... checkpoint of step 8 committed; SIGKILL worker pid {victim}", flush=True)
        os.kill(victim, signal.SIGKILL)
        rc = a.finish()
        expect(rc == 0, f"torchrun restarted the workers and the job finished (exit {rc})")
        m = re.search(r"resumed from step (\d+)", a.text)
        expect(m is not None, "the restarted workers resumed from a checkpoint")
        before = a.text[:m.start()]
        last = saved_steps(before)[-1]
        expect(int(m.group(1)) == last, f"resumed from step {m.group(1)}, the last committed "
                                        f"before the kill ({last})")
        expect("final step 24" in a.text, "trained to step 24")
    return root


def phase_reshard(workdir: str, root: str) -> None:
    print("\n==> 2. the same job again, now on 2 ranks and to step 32: resharded restore")
    args = ["--steps", "32", "--ckpt-root", root, *TRAIN_ARGS]
    log = os.path.join(workdir, "2-reshard.log")
    with Agent("2 ranks", standalone_args(2, 0), args, echo=True, log_path=log) as a:
        rc = a.finish()
        expect(rc == 0, f"the 2-rank job finished (exit {rc})")
        expect("world 2, cpu; resumed from step 24" in a.text,
               "2 ranks resumed the 4-rank checkpoint of step 24")
        pos = 24 * 4 * BATCH
        expect(f"data position {pos} " in a.text,
               f"the sampler continues at global sample {pos} (24 steps x 4 ranks x {BATCH})")


def phase_multi_agent(workdir: str, nproc: int) -> None:
    print(f"\n==> 3. two torchrun agents x {nproc} ranks, --nnodes=1:2, c10d rendezvous; "
          "agent B is SIGKILLed")
    root = os.path.join(workdir, "ckpt-elastic")
    port, run_id = free_port(), "elastic-demo"
    args = ["--steps", "40", "--ckpt-root", root, *TRAIN_ARGS]
    logs = {n: os.path.join(workdir, f"3-agent-{n}.log") for n in "AB"}
    # A hosts the c10d rendezvous store; B connects to it. Killing A would take the
    # rendezvous down with it (B's agent then fails at once: "The connection to the C10d
    # store has failed"), so the agent that dies is B, the one that is not the host.
    print(f"    agent A hosts the rendezvous store on 127.0.0.1:{port}; B joins it", flush=True)
    with Agent("A", rdzv_args(port, run_id, nproc, 2, host=True), args, echo=True,
               log_path=logs["A"]) as a:
        with Agent("B", rdzv_args(port, run_id, nproc, 2, host=False), args, echo=True,
                   log_path=logs["B"]) as b:
            world = 2 * nproc
            # Rank 0's agent logs the start, then commits at that size.
            wait_for([a, b], rf"world {world}, cpu[\s\S]*saved \S+step-00000008")
            last = max(saved_steps(a.text) + saved_steps(b.text))
            workers = b.kill()
            print(f"    ... step {last} committed; SIGKILLed agent B (pid {b.proc.pid}) "
                  f"and its workers {workers}", flush=True)
        m = a.wait_for(rf"world {nproc}, cpu; resumed from step (\d+)[\s\S]*?data position (\d+) ")
        step, pos = int(m.group(1)), int(m.group(2))
        expect(step >= last and step % 4 == 0,
               f"agent A re-rendezvoused alone: world {nproc}, resumed from step {step} "
               f"(last commit seen before the kill: {last})")
        expected = position_at([a, b], world, step)
        expect(pos == expected, f"the sampler resumed at global position {pos}, where the "
                                f"{world}-rank job was at step {step} ({expected})")
        rc = a.finish()
        expect(rc == 0 and "final step 40" in a.text, f"agent A finished step 40 (exit {rc})")
    final = os.path.join(root, "step-00000040")
    out = subprocess.run([sys.executable, "-m", "dckpt", "verify", final],
                         capture_output=True, text=True)
    print("    $ dckpt verify " + final + "\n    " + out.stdout.strip())
    expect(out.returncode == 0, "the final checkpoint verifies")


def phase_peer(workdir: str, nproc: int) -> None:
    print(f"\n==> 4. two agents x {nproc} ranks, one node each with its own local_root, "
          "--replicas 1; agent B is SIGKILLed and its local_root wiped")
    base = os.path.join(workdir, "ckpt-peer")
    os.makedirs(base)
    steps = 24
    a, b = peer_agents(base, "4-run1", steps, nproc, restarts=0, step_sleep=0.25, echo=True)
    with a, b:
        # Two replications: the replicas' retention has run once.
        m = wait_for([a, b], rf"{REPLICATED}[\s\S]*{REPLICATED}", timeout=120)
        print(f"    ... steps {m.group(1)} and {m.group(2)} committed in the fast tier and "
              "replicated to the other node", flush=True)
        peers = os.path.join(base, "A", "peers")
        held = sorted(os.listdir(peers)) if os.path.isdir(peers) else []
        expect(bool(held), f"node A holds node B's step {m.group(2)} as a replica: "
                           f"A/peers/{held}")
        workers = b.kill()
        shutil.rmtree(os.path.join(base, "B"))
        print(f"    ... SIGKILLed agent B (pid {b.proc.pid}) and its workers {workers}; "
              "wiped B's local_root", flush=True)
        rc = a.finish(timeout=60)  # its workers fail on the dead peer; no restarts left
        expect(rc != 0, f"agent A's workers failed on the lost peer and A exited (exit {rc})")
    newest = max(int(s) for s in re.findall(REPLICATED, a.text + b.text))
    durable = durable_steps(os.path.join(base, "durable"))
    expect(newest not in durable, f"step {newest}, the newest replicated, is not in the durable "
                                  f"root (it holds {durable or 'nothing'})")
    print("    restarting both agents (a new rendezvous); B's local_root is empty", flush=True)
    a, b = peer_agents(base, "4-run2", steps, nproc, restarts=0, step_sleep=0.0, echo=True)
    with a, b:
        rc = (a.finish(timeout=150), b.finish(timeout=30))
    text = a.text + b.text
    expect(rc == (0, 0), f"both agents finished (exit {rc})")
    m = re.search(r"resumed from step (\d+) \((\w+) tier\)", text)
    expect(m is not None, "the restarted job resumed from a checkpoint")
    step, tier = int(m.group(1)), m.group(2)
    expect(tier == "peer" and step >= newest,
           f"it resumed from step {step} from the {tier} tier: node B's part came from A's "
           f"replica (expected: step {newest}, the newest replicated, peer tier)")
    expect(f"final step {steps}" in text, f"trained to step {steps}")
    final = os.path.join(base, "durable", f"step-{steps:08d}")
    out = subprocess.run([sys.executable, "-m", "dckpt", "verify", final],
                         capture_output=True, text=True)
    print("    $ dckpt verify " + final + "\n    " + out.stdout.strip())
    expect(out.returncode == 0, "the final checkpoint verifies")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="checkpoints and logs go here")
    p.add_argument("--nproc-per-agent", type=int, default=2,
                   help="ranks per agent in phases 3 and 4")
    args = p.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    # A fresh start: no checkpoint to resume.
    for d in ("ckpt-restart", "ckpt-elastic", "ckpt-peer"):
        shutil.rmtree(os.path.join(args.workdir, d), ignore_errors=True)
    t0 = time.monotonic()
    try:
        root = phase_restart(args.workdir)
        phase_reshard(args.workdir, root)
        phase_multi_agent(args.workdir, args.nproc_per_agent)
        phase_peer(args.workdir, args.nproc_per_agent)
    except DemoError as e:
        print(f"\nFAILED: {e}\n(logs under {args.workdir})", file=sys.stderr)
        return 1
    print(f"\nall phases passed in {time.monotonic() - t0:.0f} s; logs under {args.workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
