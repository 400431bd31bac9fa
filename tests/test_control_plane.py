"""The observers' control plane against a process outside the job (issue 32, item 3): the store daemon listens on
the job's one address, lets in only clients that prove the job's secret (which rank 0 hands it on stdin, never in a
command line or a key name), and only closers' entries sealed with that secret make it exit."""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from scout_core.progress import control
from scout_core.progress.control import CLOSED_KEY, choose_control_plane, daemon_key, start_store_daemon
from scout_core.progress.sealed import seal_entry
from scout_core.progress.store_client import PlainStore, StoreUnreachable
from scout_core.testing.launcher import free_port_block


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
    """A process without the job's secret cannot even talk to the daemon (torch's client, ours without the
    secret or with a guessed one): it cannot make it exit. Only closers' entries sealed with the job's secret
    count, each rank once. The secret is in no argv."""
    secret = "5e" * 16
    port = start_store_daemon(2, free_port_block(1), idle_exit_s=20.0, secret=secret)  # a port of its own: found in ps
    deadline = time.monotonic() + 10
    while not _daemon_pids(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = _daemon_pids(port)
    assert len(pids) == 1
    assert secret.encode() not in Path(f"/proc/{pids[0]}/cmdline").read_bytes()  # not visible to `ps`
    key = daemon_key(CLOSED_KEY)
    closer = PlainStore("127.0.0.1", port, timeout_s=10, secret=secret).underlying_store
    closer.append(key, seal_entry(secret, key, "0"))  # one of the job's two ranks closed
    with pytest.raises(Exception):  # noqa: B017, PT011 - torch's client raises its own error types
        TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=3))
    for guess in ("", "0" * 32):
        with pytest.raises(StoreUnreachable):
            PlainStore("127.0.0.1", port, timeout_s=3, secret=guess).append(key, seal_entry(guess, key, "1"))
    closer.append(key, closer.get(key).decode())  # the genuine entry again: still one rank
    closer.append(key, "1," + seal_entry("0" * 32, key, "1"))  # unsealed, and sealed with a guessed secret
    time.sleep(6.5)  # the daemon looks every 5 s
    assert _alive(pids[0]), "an entry not sealed with the job's secret stopped the daemon"
    closer.append(key, seal_entry(secret, key, "1"))  # the job's other rank
    deadline = time.monotonic() + 15
    while _alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pids[0])


def _listening(port: int) -> list[str]:
    """The local addresses listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


def test_the_daemon_listens_on_one_address_only() -> None:
    """The daemon listens on the job's one address, so nobody off this machine reaches a one-machine job's
    control plane."""
    port = start_store_daemon(1, free_port_block(1), idle_exit_s=8.0, secret="ab" * 16, bind="127.0.0.1")
    try:
        assert _listening(port) == ["0100007F"], _listening(port)  # 127.0.0.1, and no 0.0.0.0 beside it
        store = PlainStore("127.0.0.1", port, timeout_s=10, secret="ab" * 16)
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        PlainStore("127.0.0.1", port, timeout_s=10, secret="ab" * 16).append(
            daemon_key(CLOSED_KEY), seal_entry("ab" * 16, daemon_key(CLOSED_KEY), "0"))


def test_bind_address_follows_where_the_ranks_are(monkeypatch) -> None:
    from scout_core.progress.control import bind_address

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert bind_address("node-0.example", 8) == "127.0.0.1"  # every rank here: loopback, never resolved
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert bind_address("localhost", 16) == "127.0.0.1"
    assert bind_address("10.1.2.3", 16) == "10.1.2.3"  # several machines: the job's own interface
    assert bind_address("127.0.0.1", 16) == "127.0.0.1"  # the job itself names loopback
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if host == "node-0":  # Debian's /etc/hosts: the hostname is 127.0.1.1 here, the machine's address elsewhere
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
        if host == "dual":
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("2001:db8::5", 0, 0, 0)),
                    (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.4", 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert bind_address("node-0", 16) == "0.0.0.0"  # other machines may reach it by that name: said in a warning
    assert bind_address("dual", 16) == "10.1.2.4"  # IPv4 first
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert bind_address("node-0", 16) == "127.0.0.1"  # the launcher says every rank is here
    with pytest.raises(RuntimeError, match="does not resolve"):
        bind_address("no-such-host.invalid", 8)


def test_under_torchrun_rank_0_starts_the_daemon_on_its_own_machine(monkeypatch) -> None:
    """torchrun's rendezvous store answers anyone, so the daemon serves torchrun jobs too; MASTER_ADDR (the
    rendezvous host) need not be rank 0's machine: the daemon then listens on this machine's address toward it."""
    started = []
    monkeypatch.setattr(control, "start_store_daemon",
                        lambda world, port, *, secret, bind, clientless_s: started.append(bind) or 4242)
    monkeypatch.setattr(control, "_route_to", lambda address: "10.7.7.7")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    plane = choose_control_plane("", rank=0, world_size=4)
    assert (plane.kind, plane.host, plane.port, started) == ("daemon", "127.0.0.1", 4242, ["127.0.0.1"])
    assert choose_control_plane("", rank=1, world_size=4) is None  # rank 0 shares its plane
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.10")  # another machine (TEST-NET: never this one's)
    plane = choose_control_plane("", rank=0, world_size=8)
    assert (plane.host, started[-1]) == ("10.7.7.7", "10.7.7.7")
    with pytest.raises(RuntimeError, match="not an address of rank 0's machine"):
        choose_control_plane("", rank=0, world_size=8, advertise="192.0.2.10")
    configured = choose_control_plane("store.example:1234", rank=3, world_size=8)
    assert (configured.kind, configured.host, configured.port) == ("configured", "store.example", 1234)


def test_a_fixed_port_an_earlier_daemon_still_holds_is_waited_for(monkeypatch) -> None:
    """A restart under torchrun with observer.store_port set: the previous attempt's daemon frees the port once
    its observers are gone; the new one waits for it instead of failing every rank's start."""
    import threading

    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    threading.Timer(1.0, holder.close).start()
    listener = control._listen("127.0.0.1", port)
    assert listener.getsockname()[1] == port
    listener.close()
    monkeypatch.setattr(control, "BIND_RETRY_S", 0.5)
    holder = socket.create_server(("127.0.0.1", 0))
    with pytest.raises(OSError):
        control._listen("127.0.0.1", holder.getsockname()[1])
    holder.close()


def test_the_closed_list_is_read_once_per_entry() -> None:
    secret = "c1" * 16
    key = daemon_key(CLOSED_KEY)
    closers = control._Closers(secret)
    raw = seal_entry(secret, key, "0") + "1:" + "0" * 32 + "," + seal_entry(secret, key, "2")[:-5]  # one forged
    assert closers.update(raw.encode()) == {"0"}  # rank 2's entry is still arriving
    raw = raw[:raw.rindex(",") + 1] + seal_entry(secret, key, "2") + seal_entry(secret, key, "0")
    assert closers.update(raw.encode()) == {"0", "2"}


def test_the_daemon_outlives_a_reconnect_and_exits_once_its_observers_are_gone() -> None:
    """Observers hold a connection from start-up to their closing messages; one that broke waits before it
    connects again. A daemon with none connected for longer than that exits: its job is gone (a restarted job
    wants the port back before the two-minute idle time)."""
    secret = "d4" * 16
    port = start_store_daemon(1, free_port_block(1), idle_exit_s=60.0, secret=secret, clientless_s=3.0)
    deadline = time.monotonic() + 10
    while not _daemon_pids(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    (pid,) = _daemon_pids(port)
    time.sleep(6)  # no observer yet: a daemon waits for its job
    assert _alive(pid)
    PlainStore("127.0.0.1", port, timeout_s=10, secret=secret).close()
    time.sleep(1.5)  # shorter than its limit: the observer that connects again finds it
    observer = PlainStore("127.0.0.1", port, timeout_s=10, secret=secret)
    observer.set("k", "v")
    observer.close()
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), "the daemon outlived its observers"
