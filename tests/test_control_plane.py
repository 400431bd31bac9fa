"""The observers' store daemon counts only its own job's closers (issue 32, item 3, in part): its job-wide counters
live under a secret rank 0 hands it on stdin (never in its command line), so a process that counts the unscoped key
of an earlier release, or a guessed one, does not stop it. (Any client can still list a TCPStore's keys: see
docs/security.md.)"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore

from scout_core.progress.control import CLOSED_KEY, daemon_key, start_store_daemon
from scout_core.testing.launcher import free_port


def _daemon_pids(port: int) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"scout_core.progress.control" in argv and str(port).encode() in argv:
            pids.append(int(proc.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_only_the_jobs_secret_stops_the_daemon() -> None:
    secret = "5e" * 16
    port = start_store_daemon(2, free_port(), idle_exit_s=20.0, secret=secret)  # a port of its own: found in ps
    deadline = time.monotonic() + 10
    while not _daemon_pids(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = _daemon_pids(port)
    assert len(pids) == 1
    assert secret.encode() not in Path(f"/proc/{pids[0]}/cmdline").read_bytes()  # not visible to `ps`
    outsider = TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=10))
    outsider.add(daemon_key(CLOSED_KEY), 100)  # the unscoped key every earlier release counted
    outsider.add(f"scout/{'0' * 32}/{CLOSED_KEY}", 100)  # a guessed secret
    time.sleep(6.5)  # the daemon looks every 5 s
    assert _alive(pids[0]), "a process without the job's secret stopped the daemon"
    outsider.add(daemon_key(CLOSED_KEY, secret), 2)  # the job's own closers, who know it
    deadline = time.monotonic() + 15
    while _alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pids[0])
