"""The observer's plain-Python store client against torch's real TCPStore server (the pinned torch)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import PrefixStore, TCPStore

from scout_core.progress.store_client import MAX_VALUE_BYTES, PlainStore, StoreTimeout, StoreUnreachable


@pytest.fixture
def server() -> TCPStore:
    return TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10))


def test_same_keys_and_values_as_torchs_prefix_store(server: TCPStore) -> None:
    ours = PlainStore("127.0.0.1", server.port, timeout_s=5, prefix="scout/run")
    theirs = PrefixStore("scout/run", server)
    ours.set("a", "one")
    theirs.set("b", b"\x00\xff" * 2000)
    assert theirs.get("a") == b"one" and ours.get("b") == b"\x00\xff" * 2000
    assert ours.check(["a", "b"]) and not ours.check(["a", "missing"])
    assert ours.compare_set("ep", "", "0") == b"0"
    assert ours.compare_set("ep", "7", "8") == b"0"  # not swapped: the current value comes back
    assert ours.compare_set("ep", "0", "1") == b"1" and theirs.get("ep") == b"1"
    ours.append("list", "1,")
    ours.append("list", "2,")  # one connection: in order (appends across connections may land either way)
    assert ours.multi_get(["a", "list"]) == [b"one", b"1,2,"]
    assert ours.underlying_store.get("scout/run/a") == b"one"
    ours.prefixed("ep/3").set("open", "x")
    assert theirs.get("ep/3/open") == b"x"
    assert ours.add("n", 3) == 3 and ours.add("n", 2) == 5 and ours.delete_key("n") and not ours.check(["n"])


def test_wait_returns_when_another_client_sets_the_key(server: TCPStore) -> None:
    ours = PlainStore("127.0.0.1", server.port, timeout_s=5)
    threading.Timer(0.2, lambda: server.set("late", "v")).start()
    start = time.monotonic()
    ours.wait(["late"], timedelta(seconds=5))
    assert time.monotonic() - start < 4
    assert ours.get("late") == b"v"


def test_timeouts_raise_store_timeout_and_leave_the_connection_usable(server: TCPStore) -> None:
    ours = PlainStore("127.0.0.1", server.port, timeout_s=0.3)
    with pytest.raises(StoreTimeout):
        ours.wait(["never"], timedelta(seconds=0.2))
    with pytest.raises(StoreTimeout):
        ours.get("never")  # get waits for its key, like torch's
    ours.set("k", "v")  # the cancelled waits left no answer behind to be read as this one's
    assert ours.get("k") == b"v" and ours.check(["k"])


def test_an_unreachable_or_foreign_server_is_a_clear_error() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(StoreUnreachable, match="cannot reach"):
        PlainStore("127.0.0.1", port, timeout_s=0.3)  # nothing listens
    listener = socket.create_server(("127.0.0.1", 0))

    def answer_garbage() -> None:
        conn, _ = listener.accept()
        conn.recv(64)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n")
        time.sleep(0.5)
        conn.close()

    threading.Thread(target=answer_garbage, daemon=True).start()
    with pytest.raises(StoreUnreachable, match="TCPStore protocol"):
        PlainStore("127.0.0.1", listener.getsockname()[1], timeout_s=2)
    listener.close()


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


_HELLO = 10  # validate (1 + 4 bytes) and ping (1 + 4): the ping's nonce is the last 4


def test_a_huge_length_from_the_server_is_refused_not_allocated() -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def lie() -> None:
        conn, _ = listener.accept()
        conn.sendall(_read_exactly(conn, _HELLO)[-4:])  # echo the ping's nonce
        conn.recv(64)  # the compare-set
        conn.sendall((MAX_VALUE_BYTES + 1).to_bytes(8, sys.byteorder))
        time.sleep(0.5)
        conn.close()

    threading.Thread(target=lie, daemon=True).start()
    client = PlainStore("127.0.0.1", listener.getsockname()[1], timeout_s=2)
    with pytest.raises(StoreUnreachable, match="refused"):
        client.compare_set("k", "", "v")
    listener.close()


def test_a_server_that_goes_away_is_unreachable_not_a_hang() -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def close_after_hello() -> None:
        conn, _ = listener.accept()
        conn.sendall(_read_exactly(conn, _HELLO)[-4:])
        conn.recv(64)
        conn.close()

    threading.Thread(target=close_after_hello, daemon=True).start()
    client = PlainStore("127.0.0.1", listener.getsockname()[1], timeout_s=5)
    start = time.monotonic()
    with pytest.raises(StoreUnreachable, match="closed"):
        client.check(["k"])
    assert time.monotonic() - start < 2
    listener.close()


def test_sockets_numbered_past_1023_work(server: TCPStore) -> None:
    """A trainer with many files open (NCCL, data-loader workers): the observer's socket gets a high number."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        ours = PlainStore("127.0.0.1", server.port, timeout_s=5)
        assert ours._conn.sock.fileno() > 1023
        ours.set("k", "v")
        assert ours.get("k") == b"v"
        with pytest.raises(StoreTimeout):
            ours.wait(["never"], timedelta(seconds=0.1))
    finally:
        for fd in held:
            os.close(fd)


def test_a_call_cut_off_half_way_closes_the_connection_rather_than_misread_the_next(server: TCPStore) -> None:
    """A signal handler that raises while a wait is in flight (the observer's SIGTERM): the wait's answer
    would otherwise be read as the next call's."""
    ours = PlainStore("127.0.0.1", server.port, timeout_s=5)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            ours.wait(["ep/0/verdict"], timedelta(seconds=5))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    server.set("ep/0/verdict", "x")  # its STOP_WAITING answer is now on its way to a closed socket
    with pytest.raises(StoreUnreachable, match="cut off"):
        ours.check(["ep/0/open"])
    fresh = PlainStore("127.0.0.1", server.port, timeout_s=5)
    assert not fresh.check(["ep/0/open"]) and fresh.check(["ep/0/verdict"])


def test_a_vanished_server_is_an_error_not_sigpipe() -> None:
    """A forked observer inherits its trainer's SIGPIPE disposition; writing to a closed peer must not kill it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def close_after_hello() -> None:
        conn, _ = listener.accept()
        conn.sendall(_read_exactly(conn, _HELLO)[-4:])
        conn.close()

    threading.Thread(target=close_after_hello, daemon=True).start()
    client = PlainStore("127.0.0.1", listener.getsockname()[1], timeout_s=2)
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        time.sleep(0.2)
        with pytest.raises(StoreUnreachable):
            for _ in range(50):
                client.set("k", "v" * 65536)
    finally:
        signal.signal(signal.SIGPIPE, previous)
        listener.close()


def test_the_observers_modules_import_no_torch() -> None:
    """What the observer runs needs no torch: a forked observer uses none of torch's client state, and a
    fresh one would start in a fraction of a second."""
    code = ("import sys; import scout_core.progress.observer, scout_core.progress.closing, scout_core.progress.spawn, "
            "scout_core.progress.delivery, scout_core.actions, scout_core.durable_files; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'omegaconf')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
