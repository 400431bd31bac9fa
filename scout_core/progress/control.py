"""The observers' control plane: a key-value store that outlives any rank (paper section 7).

Observers exchange nothing while the job is healthy except a bounded
heartbeat; in a stall they post their evidence to this store and read their
peers'. It must survive the death of any trainer, of any observer and of any
machine but its own, so it is never served by a rank. In order of preference:

1. ``observer.control_store: host:port`` (or ``SCOUT_CONTROL_STORE``): a
   ``TCPStore`` someone else serves (a launcher, a cluster service);
2. under ``torchrun``, the elastic agent's rendezvous store
   (``TORCHELASTIC_USE_AGENT_STORE=True``, at ``MASTER_ADDR:MASTER_PORT``): it is
   served by the agent on node 0, which outlives its workers, and it is the
   store the job itself rendezvoused through;
3. otherwise (jobs started without an agent: ``mpirun``, ``srun``, a bare
   ``init_process_group``) rank 0 starts a **store daemon**: a fresh
   interpreter in its own session, so it survives rank 0's trainer and
   observer being killed, that serves a ``TCPStore`` and exits once every rank has closed SCOUT, or no
   observer has sent a heartbeat for ``DAEMON_IDLE_EXIT_S`` (the job is gone).

Keys live under ``scout/<run id>/`` so that they never collide with the job's.

The loss of the store's own machine: every observer then loses the store at
once, and each reports on its own (no exchange is possible) that the control
plane's host is unreachable, scope ``machine``, naming that host; that is
what the other machines see when node 0 is gone (see ``observer.py``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["ControlPlane", "choose_control_plane", "connect", "daemon_key",
           "start_store_daemon", "CONTROL_STORE_ENV",
           "DAEMON_IDLE_EXIT_S", "BEAT_KEY", "CLOSED_KEY"]

CONTROL_STORE_ENV = "SCOUT_CONTROL_STORE"
DAEMON_IDLE_EXIT_S = 120.0
"""A store daemon with no heartbeat for this long exits (its job is gone)."""
BEAT_KEY = "beat"
CLOSED_KEY = "closed"
"""Each rank's observer adds one when its trainer closes SCOUT; the daemon exits when all have."""


@dataclass(frozen=True)
class ControlPlane:
    host: str
    port: int
    kind: str
    """``configured``, ``agent`` (torchrun's store) or ``daemon`` (started by rank 0)."""
    secret: str = ""
    """A random token only the job's processes know (rank 0 makes it and shares it in the start-up exchange):
    the daemon's job-wide counters live under it, so nobody who merely reaches the port can stop the daemon."""

    @property
    def needs_beats(self) -> bool:
        """Only a daemon measures its job's life by the observers' heartbeats."""
        return self.kind == "daemon"

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "kind": self.kind, "secret": self.secret}


def _parse(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be host:port, got {address!r}")
    return host, int(port)


def choose_control_plane(configured: str, *, rank: int, world_size: int, bind_port: int = 0,
                         advertise: str = "") -> ControlPlane | None:
    """The control plane this job uses, as far as this rank can tell without talking to the others.

    Returns None on ranks other than 0 when a daemon is needed: rank 0 starts it and shares its address.
    """
    address = configured or os.environ.get(CONTROL_STORE_ENV, "")
    if address:
        return ControlPlane(*_parse(address, "observer.control_store"), kind="configured")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("MASTER_ADDR"):
        return ControlPlane(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), kind="agent")
    if rank != 0:
        return None
    import socket

    host = advertise or os.environ.get("MASTER_ADDR") or socket.gethostname()
    secret = secrets.token_hex(16)
    return ControlPlane(host, start_store_daemon(world_size, bind_port, secret=secret), kind="daemon", secret=secret)


def connect(plane: ControlPlane, run_id: str, timeout_s: float) -> Any:
    """A client of the control store, with keys under ``scout/<run_id>/``."""
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(plane.host, plane.port, None, False, timeout=timedelta(seconds=timeout_s))
    return PrefixStore(f"scout/{run_id}", store)


DAEMON_START_S = 60.0
"""How long rank 0 waits for the daemon's port (a fresh interpreter importing torch)."""


def start_store_daemon(world_size: int, port: int = 0, idle_exit_s: float = DAEMON_IDLE_EXIT_S, *,
                       secret: str = "") -> int:
    """Start a store daemon detached from this process; return the port it serves.

    A fresh interpreter (``python -m scout_core.progress.control``), not a fork of the trainer: the trainer
    may run CUDA, NCCL and threads whose locks a forked child would inherit held. It forks once more at
    once (a fresh interpreter has no threads, so that fork is safe) and its first process exits: the daemon
    is then nobody's child in the job (re-parented to init), so no trainer has to reap it and none counts
    it among its processes. ``start_new_session``: it is in no process group or session of the job, so
    killing rank 0 (or its group) leaves it serving. It holds none of the trainer's files (``close_fds``);
    what it writes to stderr before it serves is kept in a file and quoted if it fails to start.
    """
    import scout_core

    root = os.path.dirname(os.path.dirname(os.path.abspath(scout_core.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    try:
        log: Any = tempfile.TemporaryFile(prefix="scout-control-")
    except OSError:  # no writable temporary directory (a read-only container): start-up errors go unquoted
        log = open(os.devnull, "wb")  # noqa: SIM115 - closed by the with below
    with log:
        first = subprocess.Popen(
            [sys.executable, "-m", "scout_core.progress.control", str(port), str(world_size), str(idle_exit_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
            close_fds=True, env=env, cwd="/",
        )
        assert first.stdout is not None and first.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # the secret on stdin: never in its command line (ps shows that)
            first.stdin.write(secret.encode() + b"\n")
            first.stdin.close()
        line = b""
        with selectors.DefaultSelector() as sel:  # not select(): the pipe's number may be above 1023
            sel.register(first.stdout, selectors.EVENT_READ)
            if sel.select(DAEMON_START_S):
                line = first.stdout.readline()
        first.stdout.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            first.wait(timeout=5.0)  # it exits right after forking the daemon
        if not line.strip().isdigit():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(first.pid, signal.SIGKILL)  # its session's group: the forked daemon too
            first.wait()
            tail = ""
            with contextlib.suppress(OSError):
                log.seek(0)
                tail = log.read()[-2000:].decode(errors="replace").strip()
            raise RuntimeError(f"the SCOUT control-store daemon did not start within {DAEMON_START_S:.0f} s"
                               + (f": {tail}" if tail else ""))
    return int(line)


def _serve(port: int, world_size: int, idle_exit_s: float) -> None:
    secret = sys.stdin.readline().strip()
    if os.fork() > 0:  # detach: our parent (rank 0) reaps this first process at once
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the job's terminal is not for us
    from torch.distributed import TCPStore

    server = TCPStore("0.0.0.0", port, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    print(server.port, flush=True)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # rank 0 closed its end: nothing more goes there
    os.dup2(null, 2)  # nor to the start-up log
    last, since = None, time.monotonic()
    while True:
        time.sleep(min(5.0, idle_exit_s / 4))
        if int(server.add(daemon_key(CLOSED_KEY, secret), 0)) >= world_size:
            time.sleep(1.0)  # let the last closers finish their message
            return
        beats = server.add(daemon_key(BEAT_KEY, secret), 0)
        if beats != last:
            last, since = beats, time.monotonic()
        elif time.monotonic() - since > idle_exit_s:
            return


def daemon_key(key: str, secret: str = "") -> str:
    """The raw (unprefixed) key of a daemon-wide counter, for ``store.underlying_store``. One daemon serves one
    job, so it needs no run id; the job's secret keeps anyone else from counting."""
    return f"scout/{secret}/{key}" if secret else f"scout/{key}"


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
