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
    monkeypatch.setattr(store_server, "MAX_UNPROVEN", 64)
    flood = [socket.create_connection(("127.0.0.1", _port(served))) for _ in range(64 + 20)]
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


def _proven(server: StoreServer) -> socket.socket:
    sock, challenge = _raw(server)
    mine = os.urandom(CHALLENGE_BYTES)
    sock.sendall(bytes([AUTH]) + mine + client_proof(SECRET, challenge, mine))
    assert len(sock.recv(32)) == 32
    sock.sendall(bytes([0]) + (0x3C85F7CE).to_bytes(4, "little"))  # torch's VALIDATE
    return sock


def _frame(command: int, *blobs: bytes) -> bytes:
    return bytes([command]) + b"".join(len(b).to_bytes(8, "little") + b for b in blobs)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return data


def test_commands_split_across_packets_or_many_in_one_are_each_answered(served: StoreServer) -> None:
    sock = _proven(served)
    big = os.urandom(3 << 20)
    frame = _frame(1, b"/big", big)  # SET, sent a few bytes at a time at first, then the rest
    for i in range(0, 39, 3):
        sock.sendall(frame[i:i + 3])
        time.sleep(0.001)
    sock.sendall(frame[39:])
    sock.sendall(_frame(3, b"/big"))  # GET
    assert int.from_bytes(_recv_exactly(sock, 8), "little") == len(big)
    assert _recv_exactly(sock, len(big)) == big
    sock.sendall(_frame(3, b"/big") * 50)  # 50 GETs in one send
    for _ in range(50):
        assert int.from_bytes(_recv_exactly(sock, 8), "little") == len(big)
        assert _recv_exactly(sock, len(big)) == big
    sock.close()


def test_a_command_that_fails_drops_its_client_and_the_server_serves_on(served: StoreServer) -> None:
    job = _client(served)
    job.add("n", 2**63 - 1)
    with pytest.raises(StoreUnreachable):
        job.add("n", 1)  # past a 64-bit integer: this client goes
    other = _client(served)
    assert other.get("n") == str(2**63 - 1).encode()  # nothing stored by the failed add, and still serving


def test_out_of_descriptors_it_neither_spins_nor_stops_serving() -> None:
    """A daemon whose descriptors run out (thousands of observers under a low limit) used to wake ``select``
    at once, forever, burning a core, because the listener stayed readable."""
    import multiprocessing
    import resource

    ctx = multiprocessing.get_context("fork")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    cpu = ctx.Queue()

    def serve() -> None:
        open_now = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 8, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        server = StoreServer(listener, SECRET)
        server.serve(1.0)  # the clients connect meanwhile
        start = time.process_time()
        server.serve(2.0)
        cpu.put(time.process_time() - start)

    child = ctx.Process(target=serve)
    child.start()
    time.sleep(0.3)
    held = []
    for _ in range(30):  # connected by the kernel's backlog, never accepted past the limit
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        held.append(sock)
    used = cpu.get(timeout=20)
    child.join(10)
    for sock in held:
        sock.close()
    listener.close()
    assert used < 0.5, f"the server used {used:.2f} s of CPU in 2 s while out of descriptors"


def test_the_server_tracks_when_its_last_client_left(served: StoreServer) -> None:
    assert served.last_client_at is None and served.clients == 0  # none yet: a daemon waits for its job
    job = _client(served)
    job.set("k", "v")
    assert served.clients == 1 and served.last_client_at is None
    job.close()
    deadline = time.monotonic() + 5
    while served.last_client_at is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.clients == 0 and served.last_client_at is not None
