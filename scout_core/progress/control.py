"""The observers' control plane: a key-value store that outlives any rank (paper section 7).

Observers exchange nothing while the job is healthy except a bounded
heartbeat; in a stall they post their evidence to this store and read their
peers'. It must survive the death of any trainer, of any observer and of any
machine but its own, so it is never served by a rank. In order of preference:

1. by default, under ``torchrun`` as under ``mpirun``, ``srun`` or a bare ``init_process_group``, rank 0
   starts a **store daemon**: a fresh interpreter in its own session, so it survives rank 0's trainer and
   observer being killed, that serves the store to clients that prove the job's secret
   (:mod:`~scout_core.progress.store_server`) and exits once every rank has closed SCOUT, or no observer has
   sent a heartbeat for ``DAEMON_IDLE_EXIT_S`` (the job is gone). torchrun's own rendezvous store is not used:
   whoever reaches it can delete keys, and a rank whose evidence vanished is named lost;
2. ``observer.control_store: host:port`` (or ``SCOUT_CONTROL_STORE``): a ``TCPStore`` someone else serves (a
   launcher, a cluster service). It authenticates nobody: the values a verdict is built from are sealed
   (:mod:`~scout_core.progress.sealed`), but whoever reaches it can delete them.

Keys live under ``scout/<run id>/`` so that they never collide with the job's.

The loss of the store's own machine: every observer then loses the store at
once, and each reports on its own (no exchange is possible) that the control
plane's host is unreachable, scope ``machine``, naming that host; that is
what the other machines see when node 0 is gone (see ``observer.py``).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import os
import resource
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from scout_core.progress.sealed import unseal, unseal_entries
from scout_core.progress.store_client import PlainStore

__all__ = ["ControlPlane", "bind_address", "choose_control_plane", "closed_ranks", "connect", "daemon_key",
           "start_store_daemon", "CONTROL_STORE_ENV",
           "DAEMON_IDLE_EXIT_S", "BEAT_KEY", "CLOSED_KEY"]

_log = logging.getLogger(__name__)

CONTROL_STORE_ENV = "SCOUT_CONTROL_STORE"
DAEMON_IDLE_EXIT_S = 120.0
"""A store daemon with no heartbeat for this long exits (its job is gone)."""
BEAT_KEY = "beat"
"""Observers set it to a new sealed value every few seconds; a daemon that sees no change for its idle time
exits."""
CLOSED_KEY = "closed"
"""Each rank's observer appends its rank, sealed, when its trainer closes SCOUT; the daemon exits when all have."""


@dataclass(frozen=True)
class ControlPlane:
    host: str
    port: int
    kind: str
    """``daemon`` (started by rank 0; it asks every client for the secret) or ``configured`` (a TCPStore the
    user named)."""
    secret: str = field(default="", repr=False)
    """A random token only the job's processes know (rank 0 makes it and shares it in the start-up exchange,
    over the job's process group): the daemon lets in only clients that prove it, and the observers seal what
    a verdict is built from with it (:mod:`scout_core.progress.sealed`), and the daemon's closers and
    heartbeats too."""

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


def observer_timing(heartbeat_s: float, gather_timeout_s: float, world_size: int) -> tuple[float, float]:
    """The heartbeat and gather timeout observers use at this world size: the heartbeat raised so the store
    serves at most 20k checks per second, the gather at least three heartbeats."""
    heartbeat = max(heartbeat_s, world_size / 20000)
    return heartbeat, max(gather_timeout_s, 3 * heartbeat)


def clientless_exit_s(heartbeat_s: float, gather_timeout_s: float) -> float:
    """How long a daemon with no observer connected waits before it exits: longer than an observer whose
    connection broke waits before connecting again (``observer._control_plane_lost``), with a margin for a
    loaded machine. Observers hold their connection from start-up to their closing messages."""
    return gather_timeout_s + 2 * heartbeat_s + CLIENTLESS_MARGIN_S


CLIENTLESS_MARGIN_S = 30.0


def choose_control_plane(configured: str, *, rank: int, world_size: int, bind_port: int = 0,
                         advertise: str = "", clientless_s: float = DAEMON_IDLE_EXIT_S) -> ControlPlane | None:
    """The control plane this job uses, as far as this rank can tell without talking to the others.

    Returns None on ranks other than 0 when a daemon is needed: rank 0 starts it and shares its address.
    """
    address = configured or os.environ.get(CONTROL_STORE_ENV, "")
    # Rank 0's plane, secret included, is the job's (handed to every rank in the start-up exchange).
    secret = secrets.token_hex(16)
    if address:
        return ControlPlane(*_parse(address, "observer.control_store"), kind="configured", secret=secret)
    if rank != 0:
        return None
    host = advertise or os.environ.get("MASTER_ADDR") or socket.gethostname()
    bind = bind_address(host, world_size)
    if bind == LOOPBACK:
        host = LOOPBACK  # every rank is on this machine: they reach it there
    elif bind != WILDCARD and not _is_local(bind):
        if advertise:
            raise RuntimeError(f"observer.store_addr {advertise!r} ({bind}) is not an address of rank 0's machine, "
                               "where SCOUT's store daemon runs")
        # MASTER_ADDR names another machine (torchrun's rendezvous host need not be rank 0's): this machine's
        # address on the way there, which the other machines reach it by.
        bind = host = _route_to(bind)
    port = start_store_daemon(world_size, bind_port, secret=secret, bind=bind, clientless_s=clientless_s)
    return ControlPlane(host, port, kind="daemon", secret=secret)


LOOPBACK = "127.0.0.1"
WILDCARD = "0.0.0.0"


def bind_address(host: str, world_size: int) -> str:
    """The one address the store daemon listens on: where the job's ranks reach it, and no other interface.

    Loopback when every rank runs on this machine (the launcher's ``LOCAL_WORLD_SIZE`` equals the world size)
    or when ``host`` (the address the daemon advertises) is ``localhost`` or a loopback address; otherwise the
    address ``host`` resolves to here (IPv4 first), which must be one of this machine's. The one exception: a
    name that resolves to loopback here (Debian's ``127.0.1.1`` for the hostname) without a launcher that says
    every rank is on this machine listens on every interface, as before, with a warning (other machines may
    resolve that name to this one); set ``observer.store_addr`` to this machine's address to avoid it.
    """
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) == world_size:
        return LOOPBACK
    try:  # IPv4 first: the ranks' clients try every address a name has, and a dual-stack job reaches it there
        infos = sorted(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM), key=lambda i: i[0] != socket.AF_INET)
    except (socket.gaierror, UnicodeError) as exc:
        raise RuntimeError(f"the store daemon's address {host!r} does not resolve here ({exc}); set "
                           "observer.store_addr to this machine's address") from exc
    address = infos[0][4][0]
    if not ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return address
    if host == "localhost" or (_is_ip(host) and ipaddress.ip_address(host.split("%")[0]).is_loopback):
        return address if address.startswith("127.") else LOOPBACK  # the job itself says: this machine only
    # A name that resolves to loopback here (Debian's 127.0.1.1 for the hostname) while other machines may
    # resolve it to this one: unless the launcher said every rank is here, they must reach the daemon.
    _log.warning("SCOUT's store daemon listens on every interface: its advertised address %r resolves to "
                 "loopback (%s) here, and ranks on other machines may need to reach it; set observer.store_addr "
                 "to this machine's address (or run under a launcher that sets LOCAL_WORLD_SIZE)", host, address)
    return WILDCARD


def _is_local(address: str) -> bool:
    """Whether ``address`` is one of this machine's (a socket can be bound to it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def _route_to(address: str) -> str:
    """This machine's address on the route to ``address`` (a UDP ``connect`` sends nothing)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
        except OSError as exc:
            raise RuntimeError(f"no route from rank 0's machine to {address} (MASTER_ADDR); set observer.store_addr "
                               "to this machine's address") from exc
        return str(probe.getsockname()[0])


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return False
    return True


def connect(plane: ControlPlane, run_id: str, timeout_s: float) -> PlainStore:
    """An observer's client of the control store, with keys under ``scout/<run_id>/``: torch's wire protocol
    spoken in plain Python (:mod:`~scout_core.progress.store_client`), so the observer uses no torch. To the
    store daemon it first proves the job's secret."""
    return PlainStore(plane.host, plane.port, timeout_s=timeout_s, prefix=f"scout/{run_id}",
                      secret=plane.secret if plane.kind == "daemon" else "")


FIRST_CLIENT_WAIT_S = 1800.0
"""How long a daemon waits for its first observer before it takes its job for gone."""
BIND_RETRY_S = 120.0
"""A fixed port a previous attempt's daemon still holds (a restart under torchrun): it frees it once its
observers are gone (they may answer for their dead trainers first) and :func:`clientless_exit_s` has passed, so
the new daemon tries this long (rank 0 waits ``DAEMON_START_S`` beyond it)."""
DAEMON_START_S = 60.0 + BIND_RETRY_S
"""How long rank 0 waits for the daemon's port (a fresh interpreter; a loaded machine may take seconds)."""


def start_store_daemon(world_size: int, port: int = 0, idle_exit_s: float = DAEMON_IDLE_EXIT_S, *,
                       secret: str = "", bind: str = LOOPBACK, clientless_s: float = DAEMON_IDLE_EXIT_S) -> int:
    """Start a store daemon detached from this process, listening on ``bind`` only; return the port it serves.

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
            first.stdin.write(json.dumps({"secret": secret, "bind": bind, "clientless_s": clientless_s}).encode()
                              + b"\n")
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
    given = json.loads(sys.stdin.readline())
    secret, bind, clientless_s = str(given["secret"]), str(given["bind"]), float(given["clientless_s"])
    if os.fork() > 0:  # detach: our parent (rank 0) reaps this first process at once
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the job's terminal is not for us
    with contextlib.suppress(ValueError, OSError):  # one connection per observer: thousands of descriptors
        resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    from scout_core.progress.store_server import StoreServer

    server = StoreServer(_listen(bind, port), secret)
    print(server.listener.getsockname()[1], flush=True)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # rank 0 closed its end: nothing more goes there
    os.dup2(null, 2)  # nor to the start-up log
    closers = _Closers(secret)
    last: bytes | None = None
    since = started = time.monotonic()
    while True:
        try:
            server.serve(min(5.0, idle_exit_s / 4))
        except Exception:  # noqa: BLE001 - a fault of ours must not end the job's store: serve on, not spin
            time.sleep(0.1)
        # Only clients that proved the secret write here; the values are still checked (the sealed closers and
        # heartbeat), and anything that does not verify counts as life: nothing but the job itself ends it.
        if len(closers.update(server.value(daemon_key(CLOSED_KEY)) or b"")) >= world_size:
            server.serve(1.0)  # let the last closers finish their message
            return
        # Every observer's connection gone for longer than any would wait to connect again: the job's processes
        # are gone (a launcher restarting the job wants this port back sooner than the idle time).
        if server.last_client_at is not None and time.monotonic() - server.last_client_at > clientless_s:
            return
        if server.last_client_at is None and not server.clients:
            # No observer yet: the other ranks may reach enable() long after rank 0 (a slow data loader's
            # start); the start-up exchange they all join waits the process group's timeout, 30 min by default.
            if time.monotonic() - started > FIRST_CLIENT_WAIT_S:
                return
            since = time.monotonic()
            continue
        beats = server.value(daemon_key(BEAT_KEY)) or b""
        try:
            if beats:
                unseal(secret, daemon_key(BEAT_KEY), beats)
        except Exception:  # noqa: BLE001 - not the job's own heartbeat: alive, as far as it can tell
            beats = None
        if beats is None or beats != last:
            last, since = beats, time.monotonic()
        elif time.monotonic() - since > idle_exit_s:
            return


def _listen(bind: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            return socket.create_server((bind, port), family=family, backlog=4096)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or not port or time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


class _Closers:
    """The ranks whose sealed entry is in the daemon's closed list; each entry is checked once (the list grows
    by one entry per rank, and is read every few seconds)."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.ranks: set[str] = set()
        self._read = 0

    def update(self, raw: bytes) -> set[str]:
        end = raw.rfind(b",") + 1  # whole entries only: the rest is still arriving
        if end > self._read:
            self.ranks |= _closed(raw[self._read:end], self.secret)
            self._read = end
        return self.ranks


def daemon_key(key: str) -> str:
    """The raw (unprefixed) key of a daemon-wide value, for ``store.underlying_store``. One daemon serves one
    job, so it needs no run id. Never the secret: key names are no place for it (a configured store lists them)."""
    return f"scout/daemon/{key}"


def closed_ranks(store: Any, secret: str) -> set[str]:
    """The ranks whose observers said their trainer closed SCOUT, from the daemon-wide list: only entries sealed
    with the job's secret count, each rank once, so nobody outside the job can make the daemon exit."""
    key = daemon_key(CLOSED_KEY)
    return _closed(store.get(key), secret) if store.check([key]) else set()


def _closed(raw: bytes, secret: str) -> set[str]:
    return set(unseal_entries(secret, daemon_key(CLOSED_KEY), raw))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
