"""The store daemon's own server (issue 32, item 3): torch's store semantics for the observers' client, and
nothing at all for a process that cannot prove the job's secret."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from scout_core.progress import store_server
from scout_core.progress.store_client import PlainStore, StoreTimeout, StoreUnreachable
from scout_core.progress.store_server import AUTH, CHALLENGE_BYTES, StoreServer, client_proof

SECRET = "3f" * 16


@pytest.fixture
def served() -> Iterator[StoreServer]:
    server = StoreServer(socket.create_server(("127.0.0.1", 0)), SECRET)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            server.serve(0.05)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield server
    stop.set()
    thread.join()
    server.close()


def _port(server: StoreServer) -> int:
    return server.listener.getsockname()[1]


def _client(server: StoreServer, **kwargs) -> PlainStore:
    return PlainStore("127.0.0.1", _port(server), **{"timeout_s": 5, "secret": SECRET, **kwargs})


def _closed_by_peer(sock: socket.socket, seconds: float = 5.0) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def test_the_job_sees_torchs_store_semantics(served: StoreServer) -> None:
    ours, other = _client(served, prefix="scout/run"), _client(served, prefix="scout/run")
    ours.set("a", "one")
    other.set("b", b"\x00\xff" * 2000)
    assert other.get("a") == b"one" and ours.get("b") == b"\x00\xff" * 2000
    assert ours.check(["a", "b"]) and not ours.check(["a", "missing"])
    assert ours.compare_set("ep", "", "0") == b"0"
    assert ours.compare_set("ep", "7", "8") == b"0"  # not swapped: the current value comes back
    assert ours.compare_set("missing", "7", "8") == b"7"  # torch answers the expected value for a missing key
    assert ours.compare_set("ep", "0", "1") == b"1" and other.get("ep") == b"1"
    ours.append("list", "1,")
    ours.append("list", "2,")
    assert ours.multi_get(["a", "list"]) == [b"one", b"1,2,"]
    assert ours.underlying_store.get("scout/run/a") == b"one"
    assert served.value("scout/run/a") == b"one"  # the daemon reads its closers and heartbeat this way
    ours.prefixed("ep/3").set("open", "x")
    assert other.get("ep/3/open") == b"x"
    assert ours.add("n", 3) == 3 and ours.add("n", 2) == 5 and ours.delete_key("n") and not ours.check(["n"])
    assert not ours.delete_key("n")


def test_waits_end_when_another_client_sets_and_time_out_cleanly(served: StoreServer) -> None:
    waiter, setter = _client(served, timeout_s=0.3), _client(served)
    with pytest.raises(StoreTimeout):
        waiter.wait(["late"], timedelta(seconds=0.2))
    with pytest.raises(StoreTimeout):
        waiter.get("late")
    threading.Timer(0.2, lambda: setter.set("late", "v")).start()
    waiter.wait(["late"], timedelta(seconds=5))
    assert waiter.get("late") == b"v"  # the cancelled waits left no answer behind to be read as this one's
    threading.Timer(0.1, lambda: setter.append("x", "1")).start()
    waiter.wait(["x"], timedelta(seconds=5))  # an append creates the key too


def _raw(server: StoreServer) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", _port(server)), timeout=5)
    challenge = b""
    while len(challenge) < CHALLENGE_BYTES:
        challenge += sock.recv(CHALLENGE_BYTES - len(challenge))
    return sock, challenge


def _delete_frame(key: str) -> bytes:
    raw = f"/{key}".encode()
    return bytes([8]) + len(raw).to_bytes(8, "little") + raw  # torch's DELETE_KEY


def test_a_process_without_the_secret_reads_and_changes_nothing(served: StoreServer) -> None:
    """Whoever reaches the port: torch's own client, our client without the secret or with another, a replayed
    handshake, a raw delete. Each is cut off at its first bytes; the job's keys are untouched."""
    job = _client(served)
    job.set("evidence/3", "sealed")
    with pytest.raises(Exception):  # noqa: B017, PT011 - torch's client raises its own error types
        TCPStore("127.0.0.1", _port(served), None, False, timeout=timedelta(seconds=2))
    for secret in ("", "00" * 16):
        with pytest.raises(StoreUnreachable):
            PlainStore("127.0.0.1", _port(served), timeout_s=2, secret=secret).delete_key("evidence/3")
    sock, challenge = _raw(served)
    mine = os.urandom(CHALLENGE_BYTES)
    recorded = bytes([AUTH]) + mine + client_proof(SECRET, challenge, mine)  # a genuine handshake, seen on the wire
    sock.close()
    sock, _ = _raw(served)  # a fresh challenge: the recorded answer no longer fits
    sock.sendall(recorded + _delete_frame("evidence/3"))
    assert _closed_by_peer(sock)
    sock, _ = _raw(served)
    sock.sendall(_delete_frame("evidence/3"))  # no handshake at all
    assert _closed_by_peer(sock)
    assert job.get("evidence/3") == b"sealed" and served.value("evidence/3") == b"sealed"


def test_a_server_that_does_not_know_the_secret_is_refused() -> None:
    """A process that took the port after the daemon was gone cannot pose as it: the client checks its proof."""
    impostor = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = impostor.accept()
        conn.sendall(os.urandom(CHALLENGE_BYTES))
        conn.recv(1 + CHALLENGE_BYTES + 32)
        conn.sendall(b"\0" * 32)
        time.sleep(1)
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(StoreUnreachable, match="does not know this job's secret"):
        PlainStore("127.0.0.1", impostor.getsockname()[1], timeout_s=3, secret=SECRET)
    impostor.close()


def test_a_flood_of_silent_connections_neither_blocks_the_job_nor_stays(served: StoreServer, monkeypatch) -> None:
    monkeypatch.setattr(store_server, "AUTH_TIMEOUT_S", 0.5)
    flood = [socket.create_connection(("127.0.0.1", _port(served))) for _ in range(store_server.MAX_UNPROVEN + 20)]
    job = _client(served)  # the oldest silent ones made room
    job.set("k", "v")
    assert _closed_by_peer(flood[0], 2) and _closed_by_peer(flood[-1], 5)  # displaced, and timed out
    assert job.get("k") == b"v"  # a proven connection never times out
    for sock in flood:
        sock.close()


def test_a_client_that_breaks_the_protocol_is_dropped_and_others_go_on(served: StoreServer) -> None:
    job, other = _client(served), _client(served)
    other.set("k", "v")
    with pytest.raises(StoreUnreachable):
        other.add("k", 1)  # add to a value that is not a number: torch's server drops the client too
    assert job.get("k") == b"v"
