"""A client of torch's TCPStore in plain Python: what the observer talks to its control store with.

The observer needs a handful of store calls (set, get, check, wait, compare-and-set, append, multi-get) and
nothing else of torch. Speaking the store's wire protocol itself, it imports no torch: it stays small, it can
start as a fresh interpreter in a fraction of a second, and a forked observer touches none of torch's client
state (threads, locks, sockets) that the trainer held at the fork.

The protocol is torch's own (``torch/csrc/distributed/c10d/TCPStore.cpp`` and its libuv server): one byte
per command, strings and values as a native-endian uint64 length and bytes, one-byte answers to check and
wait. A connection opens with torch's validation and ping, so a server that speaks anything else is refused at
once; the tests run it against the real server of the pinned torch (2.13). Another torch version whose protocol
differs shows as an observer that cannot reach its store: ``observer.start_method: fork`` does not change that.

Semantics follow torch's client, so code written against ``torch.distributed.PrefixStore(TCPStore)`` works
unchanged: ``get`` waits for its key up to the store's timeout; ``multi_get`` waits for all of them; a timeout
raises :class:`StoreTimeout`; a closed or unreachable server raises :class:`StoreUnreachable` (both
``OSError``).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import select
import socket
import struct
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta

from scout_core.progress.store_server import AUTH, CHALLENGE_BYTES, client_proof, server_proof

__all__ = ["PlainStore", "StoreTimeout", "StoreUnreachable", "store_timeouts"]

_VALIDATE, _SET, _COMPARE_SET, _GET, _ADD, _CHECK, _WAIT = 0, 1, 2, 3, 4, 5, 6
_DELETE_KEY, _APPEND, _MULTI_GET, _CANCEL_WAIT, _PING = 8, 9, 10, 12, 13
_MAGIC = 0x3C85F7CE
_READY, _STOP_WAITING, _WAIT_CANCELED = 0, 0, 1
_U64 = struct.Struct("=Q")
_I64 = struct.Struct("=q")
_U32 = struct.Struct("=I")
MAX_VALUE_BYTES = 1 << 30
"""Refuse an answer longer than this: the observer's values are kilobytes; a larger length is a broken peer."""


class StoreTimeout(OSError):
    """A store call did not complete within the store's timeout (torch raises ``DistStoreError`` here)."""


class StoreUnreachable(OSError):
    """The store's server could not be reached, refused us, or closed the connection."""


class _HandshakeCut(StoreUnreachable):
    """The server closed the connection before it answered our proof."""


def store_timeouts() -> tuple[type[BaseException], ...]:
    """The timeout errors of every store an observer's protocol may be given: ours, and torch's where torch is
    loaded already (the tests drive the protocol with torch's in-memory store)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    extra = getattr(dist, "DistStoreError", None) if dist is not None else None
    return (StoreTimeout,) if extra is None else (StoreTimeout, extra)


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class _Connection:
    """The socket several views of one store share (``underlying_store``, ``prefixed``), and whether it broke."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.poll = select.poll()  # not select(): the observer's socket may be numbered past 1023
        self.poll.register(sock, select.POLLIN)
        self.broken = ""
        """Why the byte stream can no longer be trusted (a call cut off between its request and its answer)."""


class PlainStore:
    """One connection to a TCPStore server, with every key under ``prefix/`` (torch's ``PrefixStore`` joins the
    same way, so both see the same keys). Not thread-safe: one per thread, as the observer uses it.

    A call cut off between its request and its answer (a timeout, a signal handler raising, a dropped
    connection) leaves an answer in flight that the next call would read as its own: the connection is then
    closed, and every later call raises :class:`StoreUnreachable` (the observer reconnects). Only a ``wait``
    that times out cleanly (its cancel answered) keeps it."""

    def __init__(self, host: str, port: int, *, timeout_s: float, prefix: str = "", secret: str = "") -> None:
        self.host, self.port, self.prefix = host, int(port), prefix
        self.timeout_s = float(timeout_s)
        self._secret = secret
        """Set for SCOUT's own store daemon (:mod:`~scout_core.progress.store_server`): the connection first
        proves it, and checks the server's proof in turn."""
        self._conn = self._connect()

    # -- what the observer calls ------------------------------------------------------------------

    @property
    def underlying_store(self) -> PlainStore:
        """The same server without our prefix (``PrefixStore.underlying_store``)."""
        return self._view(prefix="")

    def prefixed(self, prefix: str) -> PlainStore:
        """The same connection with keys under ``prefix/`` as well (``PrefixStore(prefix, self)``)."""
        return self._view(prefix=f"{self.prefix}/{prefix}" if self.prefix else prefix)

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def set(self, key: str, value: str | bytes) -> None:
        with self._exchange():
            self._send(_SET, self._str(self._key(key)), self._str(_as_bytes(value)))

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._exchange():
            self._send(_GET, self._str(self._key(key)))
            return self._read_vector()

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        with self._exchange():
            self._send(_COMPARE_SET, self._str(self._key(key)), self._str(_as_bytes(expected)),
                       self._str(_as_bytes(desired)))
            return self._read_vector()

    def add(self, key: str, amount: int) -> int:
        with self._exchange():
            self._send(_ADD, self._str(self._key(key)), _I64.pack(int(amount)))
            return _I64.unpack(self._read(_I64.size))[0]

    def append(self, key: str, value: str | bytes) -> None:
        with self._exchange():
            self._send(_APPEND, self._str(self._key(key)), self._str(_as_bytes(value)))

    def delete_key(self, key: str) -> bool:
        with self._exchange():
            self._send(_DELETE_KEY, self._str(self._key(key)))
            return _I64.unpack(self._read(_I64.size))[0] == 1

    def check(self, keys: Sequence[str]) -> bool:
        with self._exchange():
            self._send(_CHECK, self._keys(keys))
            return self._read(1)[0] == _READY

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self.wait(keys)
        with self._exchange():
            self._send(_MULTI_GET, self._keys(keys))
            return [self._read_vector() for _ in keys]

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        limit = self.timeout_s if timeout is None else timeout.total_seconds()
        with self._exchange():
            self._send(_WAIT, self._keys(keys))
            if self._readable_within(limit):
                if self._read(1)[0] != _STOP_WAITING:
                    raise StoreUnreachable(f"store {self.host}:{self.port} answered a wait with something else")
                return
            self._send(_CANCEL_WAIT)
            if self._read(1)[0] != _WAIT_CANCELED:  # the keys came as we cancelled: its cancel answer follows
                self._read(1)
        # Out of the exchange: the stream is whole again, this connection stays usable.
        raise StoreTimeout(f"timed out after {limit:g} s waiting for {len(keys)} key(s) of store "
                           f"{self.host}:{self.port}")

    def close(self) -> None:
        self._conn.broken = self._conn.broken or "closed"
        self._conn.sock.close()

    # -- the wire ----------------------------------------------------------------------------------

    def _view(self, *, prefix: str) -> PlainStore:
        view = PlainStore.__new__(PlainStore)
        view.host, view.port, view.timeout_s, view._conn, view.prefix = (self.host, self.port, self.timeout_s,
                                                                         self._conn, prefix)
        view._secret = self._secret
        return view

    @contextlib.contextmanager
    def _exchange(self) -> Iterator[None]:
        """One request and its answer: cut off half-way, the connection is closed for good."""
        if self._conn.broken:
            raise StoreUnreachable(f"store {self.host}:{self.port}: connection unusable ({self._conn.broken})")
        try:
            yield
        except BaseException as exc:
            self._conn.broken = f"a call was cut off: {type(exc).__name__}"
            with contextlib.suppress(OSError):
                self._conn.sock.close()
            raise

    def _connect(self) -> _Connection:
        deadline = time.monotonic() + self.timeout_s
        while True:  # the server may not listen yet (a daemon still starting): retry until the timeout
            try:
                sock = socket.create_connection((self.host, self.port),
                                                timeout=max(0.1, min(self.timeout_s, deadline - time.monotonic())))
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise StoreUnreachable(f"cannot reach the store at {self.host}:{self.port}: {exc}") from exc
                time.sleep(0.1)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conn = _Connection(sock)
            if not self._secret:
                break
            try:
                self._prove()
                break
            except _HandshakeCut as exc:
                # The daemon closed the connection before its proof: a wrong secret, or ours was the oldest
                # handshake when it had too many (a flood, or thousands of observers starting): try again.
                if time.monotonic() >= deadline:
                    raise StoreUnreachable(f"store {self.host}:{self.port} closed every connection during the "
                                           f"handshake for {self.timeout_s:g} s: it serves another job (or "
                                           f"run), or is flooded ({exc})") from exc
                time.sleep(0.1)
        nonce = os.getpid() & 0xFFFFFFFF
        with self._exchange():
            self._send(_VALIDATE, _U32.pack(_MAGIC), bytes([_PING]), _U32.pack(nonce))
            if _U32.unpack(self._read(_U32.size))[0] != nonce:
                raise StoreUnreachable(f"{self.host}:{self.port} does not speak the TCPStore protocol")
        return self._conn

    def _prove(self) -> None:
        """The daemon's handshake: answer its challenge with the secret, and check that it knows it too."""
        try:
            with self._exchange():
                theirs = self._read(CHALLENGE_BYTES)
                ours = os.urandom(CHALLENGE_BYTES)
                self._send(AUTH, ours, client_proof(self._secret, theirs, ours))
                answer = self._read(32)
        except StoreTimeout:
            raise
        except StoreUnreachable as exc:
            raise _HandshakeCut(str(exc)) from exc
        if not hmac.compare_digest(answer, server_proof(self._secret, theirs, ours)):
            self.close()
            raise StoreUnreachable(f"store {self.host}:{self.port} does not know this job's secret: "
                                   "it is not the job's store daemon")

    def _key(self, key: str) -> str:
        return f"/{self.prefix}/{key}" if self.prefix else f"/{key}"  # torch's client puts "/" before every key

    @staticmethod
    def _str(data: str | bytes) -> bytes:
        raw = _as_bytes(data)
        return _U64.pack(len(raw)) + raw

    def _keys(self, keys: Sequence[str]) -> bytes:
        return _U64.pack(len(keys)) + b"".join(self._str(self._key(k)) for k in keys)

    def _send(self, command: int, *parts: bytes) -> None:
        view = memoryview(bytes([command]) + b"".join(parts))
        sock = self._conn.sock
        try:
            sock.settimeout(max(0.1, self.timeout_s))
            while view:  # MSG_NOSIGNAL: a vanished server is an error here, never SIGPIPE (a forked observer
                view = view[sock.send(view, socket.MSG_NOSIGNAL):]  # inherits whatever its trainer set)
        except TimeoutError as exc:
            raise StoreTimeout(f"store {self.host}:{self.port} took longer than {self.timeout_s:g} s") from exc
        except OSError as exc:
            raise StoreUnreachable(f"store {self.host}:{self.port}: {exc}") from exc

    def _readable_within(self, seconds: float) -> bool:
        try:
            return bool(self._conn.poll.poll(max(0, int(seconds * 1000))))
        except (OSError, ValueError) as exc:
            raise StoreUnreachable(f"store {self.host}:{self.port}: {exc}") from exc

    def _read(self, n: int) -> bytes:
        chunks, got = [], 0
        deadline = time.monotonic() + max(0.1, self.timeout_s)
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._readable_within(remaining):
                raise StoreTimeout(f"store {self.host}:{self.port} did not answer within {self.timeout_s:g} s")
            try:
                chunk = self._conn.sock.recv(n - got)
            except OSError as exc:
                raise StoreUnreachable(f"store {self.host}:{self.port}: {exc}") from exc
            if not chunk:
                raise StoreUnreachable(f"store {self.host}:{self.port} closed the connection")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _read_vector(self) -> bytes:
        (length,) = _U64.unpack(self._read(_U64.size))
        if length > MAX_VALUE_BYTES:
            raise StoreUnreachable(f"store {self.host}:{self.port} sent a {length}-byte value; refused")
        return self._read(length) if length else b""
