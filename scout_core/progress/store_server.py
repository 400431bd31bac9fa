"""The store daemon's server: torch's TCPStore protocol, in plain Python, behind a challenge on the job's secret.

torch's own TCPStore server answers whoever reaches its port: an outsider can list, delete and rewrite keys, and
sealed values (:mod:`~scout_core.progress.sealed`) only keep them from forging evidence, not from deleting it
(a rank whose evidence vanished is named lost). This server speaks the same protocol as torch's (the subset
:class:`~scout_core.progress.store_client.PlainStore` uses: set, get, check, wait and its cancel, compare-set,
add, append, multi-get, delete, validate and ping) but a connection must first prove it knows the job's secret.

The handshake, before any command: the server sends a 16-byte random challenge; the client answers with one
byte (``AUTH``), a 16-byte challenge of its own and the HMAC-SHA256 of the secret over both challenges; the
server answers with its own HMAC over both, so the client knows it reached its job's server and not a process
that took the port after the daemon was gone. A connection that sends anything else, or nothing within
``AUTH_TIMEOUT_S``, is closed having read nothing and changed nothing. Fresh challenges on both sides: a
recorded handshake cannot be replayed. The traffic itself is not encrypted (as torch's is not): someone who can
read or inject packets on the job's network is outside what this protects against (docs/security.md).

One thread, non-blocking sockets and ``selectors``: thousands of observers' connections, each mostly idle.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import selectors
import socket
import struct
import time
from collections import deque

__all__ = ["StoreServer", "AUTH", "AUTH_TIMEOUT_S", "CHALLENGE_BYTES", "client_proof", "server_proof"]

_VALIDATE, _SET, _COMPARE_SET, _GET, _ADD, _CHECK, _WAIT = 0, 1, 2, 3, 4, 5, 6
_DELETE_KEY, _APPEND, _MULTI_GET, _CANCEL_WAIT, _PING = 8, 9, 10, 12, 13
AUTH = 0x5C
"""The handshake's command byte: not one of torch's, so a torch client is refused at its first byte."""
_MAGIC = 0x3C85F7CE
_READY, _NOT_READY, _STOP_WAITING, _WAIT_CANCELED = 0, 1, 0, 1
_U64, _I64, _U32 = struct.Struct("=Q"), struct.Struct("=q"), struct.Struct("=I")
CHALLENGE_BYTES = 16
_MAC_BYTES = 32
AUTH_TIMEOUT_S = 10.0
"""A connection that has not proved the secret by then is closed."""
MAX_UNPROVEN = 4096
"""Connections still in the handshake at once; past it the oldest is closed (a flood cannot exhaust the fds). A
job's own client cut off this way connects again (:class:`~scout_core.progress.store_client.PlainStore`)."""
ACCEPT_PAUSE_S = 0.5
"""Out of file descriptors with no connection in the handshake to close: stop accepting this long (not spin)."""
MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 << 20
MAX_KEYS = 1 << 20
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
MAX_UNSENT_BYTES = 256 << 20
"""A client that reads none of its answers is dropped before it fills the daemon's memory."""


def client_proof(secret: str, server_challenge: bytes, client_challenge: bytes) -> bytes:
    return _mac(secret, b"scout-store client", server_challenge, client_challenge)


def server_proof(secret: str, server_challenge: bytes, client_challenge: bytes) -> bytes:
    return _mac(secret, b"scout-store server", server_challenge, client_challenge)


def _mac(secret: str, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret.encode(), label + b"\0" + first + second, hashlib.sha256).digest()


class _Short(Exception):
    """The buffer holds only part of a command: wait for more bytes."""


class _Broken(Exception):
    """The peer broke the protocol: close it."""


class _Reader:
    def __init__(self, data: bytearray) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise _Short
        out = bytes(self.data[self.at:self.at + n])
        self.at += n
        return out

    def u64(self) -> int:
        return _U64.unpack(self.take(_U64.size))[0]

    def blob(self, limit: int) -> bytes:
        n = self.u64()
        if n > limit:
            raise _Broken(f"a {n}-byte field")
        return self.take(n)

    def key(self) -> str:
        return self.blob(MAX_KEY_BYTES).decode(errors="surrogateescape")

    def keys(self) -> list[str]:
        n = self.u64()
        if n > MAX_KEYS:
            raise _Broken(f"{n} keys")
        return [self.key() for _ in range(n)]


class _Client:
    def __init__(self, sock: socket.socket, challenge: bytes) -> None:
        self.sock, self.challenge = sock, challenge
        self.since = time.monotonic()
        self.proven = False
        self.validated = False
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.waiting: set[str] = set()


class StoreServer:
    """Serves one job's control store on ``listener`` (a bound, listening socket) to clients that know
    ``secret``. Drive it with :meth:`serve` from one thread; read its values with :meth:`value`."""

    def __init__(self, listener: socket.socket, secret: str) -> None:
        if not secret:
            raise ValueError("the store server needs the job's secret")
        self.secret = secret
        self.listener = listener
        listener.setblocking(False)
        self.values: dict[str, bytearray] = {}  # appended in place: a list of 100k closers grows in O(1) steps
        self._waiters: dict[str, set[_Client]] = {}
        self._unproven: deque[_Client] = deque()
        self._proven = 0
        self.last_client_at: float | None = None
        """When a client that proved the secret was last connected (None: none ever was, or one is now)."""
        self._accept_paused_until = 0.0
        self._closed = False
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, None)

    def value(self, key: str) -> bytes | None:
        """The value of ``key`` as a client's unprefixed view names it (torch's clients put ``/`` first)."""
        found = self.values.get("/" + key)
        return None if found is None else bytes(found)

    @property
    def clients(self) -> int:
        """Connections that proved the job's secret, open now."""
        return self._proven

    def serve(self, seconds: float) -> None:
        """Answer whatever arrives for about ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            for selected, events in self._sel.select(min(left, 1.0)):
                client = selected.data
                if client is None:
                    self._accept()
                    continue
                if events & selectors.EVENT_READ:
                    self._receive(client)
                if events & selectors.EVENT_WRITE and client.sock.fileno() >= 0:
                    self._flush(client)
            self._expire_unproven()
            if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
                self._accept_paused_until = 0.0
                self._sel.register(self.listener, selectors.EVENT_READ, None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for key in list(self._sel.get_map().values()):
            if key.data is not None:
                self._drop(key.data)
        self._sel.close()
        self.listener.close()

    # -- connections ----------------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._out_of_files()
                return  # or the peer left already: serve the others
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client = _Client(sock, os.urandom(CHALLENGE_BYTES))
            if len(self._unproven) >= MAX_UNPROVEN:
                self._drop(self._unproven.popleft())
            self._unproven.append(client)
            self._sel.register(sock, selectors.EVENT_READ, client)
            self._send(client, client.challenge)

    def _out_of_files(self) -> None:
        """No descriptor for a new connection: close the oldest one still in the handshake, or stop accepting a
        moment (the listener would wake ``select`` at once, forever). The daemon raises its own limit at start."""
        if self._unproven:
            self._drop(self._unproven.popleft())
            return
        self._sel.unregister(self.listener)
        self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S

    def _expire_unproven(self) -> None:
        now = time.monotonic()
        while self._unproven and now - self._unproven[0].since > AUTH_TIMEOUT_S:
            self._drop(self._unproven.popleft())

    def _drop(self, client: _Client) -> None:
        if client.sock.fileno() < 0:
            return
        if not client.proven:
            with contextlib.suppress(ValueError):
                self._unproven.remove(client)
        else:
            self._proven -= 1
            if not self._proven:
                self.last_client_at = time.monotonic()
        self._forget_wait(client)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(client.sock)
        client.sock.close()

    def _receive(self, client: _Client) -> None:
        try:
            data = client.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(client)
            return
        client.inbox += data
        try:
            while client.inbox and client.sock.fileno() >= 0:
                reader = _Reader(client.inbox)
                try:
                    self._command(client, reader)
                except _Short:
                    return
                del client.inbox[:reader.at]
        except Exception:  # noqa: BLE001 - _Broken, or a bug: this client goes, the job's store stays
            self._drop(client)

    def _send(self, client: _Client, data: bytes) -> None:
        client.outbox += data
        if len(client.outbox) > MAX_UNSENT_BYTES:
            self._drop(client)
            return
        self._flush(client)

    def _flush(self, client: _Client) -> None:
        try:
            sent = client.sock.send(client.outbox, socket.MSG_NOSIGNAL) if client.outbox else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(client)
            return
        del client.outbox[:sent]
        self._sel.modify(client.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if client.outbox else 0), client)

    # -- the protocol ---------------------------------------------------------------------------------

    def _command(self, client: _Client, reader: _Reader) -> None:
        command = reader.take(1)[0]
        if not client.proven:
            if command != AUTH:
                raise _Broken("no handshake")
            theirs, proof = reader.take(CHALLENGE_BYTES), reader.take(_MAC_BYTES)
            if not hmac.compare_digest(proof, client_proof(self.secret, client.challenge, theirs)):
                raise _Broken("a wrong proof")
            client.proven = True
            self._unproven.remove(client)
            self._proven += 1
            self.last_client_at = None
            self._send(client, server_proof(self.secret, client.challenge, theirs))
            return
        if not client.validated:
            if command != _VALIDATE or _U32.unpack(reader.take(_U32.size))[0] != _MAGIC:
                raise _Broken("not validated")
            client.validated = True
            return
        if command == _PING:
            self._send(client, reader.take(_U32.size))
        elif command == _SET:
            key, value = reader.key(), reader.blob(MAX_VALUE_BYTES)
            self._store(key, value)
        elif command == _GET:
            self._send_blob(client, self.values.get(reader.key(), b""))
        elif command == _COMPARE_SET:
            key, expected, desired = reader.key(), reader.blob(MAX_VALUE_BYTES), reader.blob(MAX_VALUE_BYTES)
            current = self.values.get(key)
            if (current is None and not expected) or (current is not None and current == expected):
                self._store(key, desired)
                current = desired
            self._send_blob(client, expected if current is None else current)
        elif command == _ADD:
            key, amount = reader.key(), _I64.unpack(reader.take(_I64.size))[0]
            try:
                total = int(self.values.get(key, b"0")) + amount
            except ValueError:
                raise _Broken("add to a value that is not a number") from None  # as torch's server does
            if not _I64_MIN <= total <= _I64_MAX:
                raise _Broken("add past a 64-bit integer")
            self._store(key, str(total).encode())
            self._send(client, _I64.pack(total))
        elif command == _APPEND:
            key, value = reader.key(), reader.blob(MAX_VALUE_BYTES)
            current = self.values.get(key)
            if current is None:
                self._store(key, value)
            else:
                current += value
                self._wake(key)
        elif command == _DELETE_KEY:
            self._send(client, _I64.pack(1 if self.values.pop(reader.key(), None) is not None else 0))
        elif command == _CHECK:
            ready = all(k in self.values for k in reader.keys())
            self._send(client, bytes([_READY if ready else _NOT_READY]))
        elif command == _MULTI_GET:
            for key in reader.keys():
                self._send_blob(client, self.values.get(key, b""))
        elif command == _WAIT:
            missing = {k for k in reader.keys() if k not in self.values}
            if not missing:
                self._send(client, bytes([_STOP_WAITING]))
                return
            client.waiting = missing
            for key in missing:
                self._waiters.setdefault(key, set()).add(client)
        elif command == _CANCEL_WAIT:
            self._forget_wait(client)
            self._send(client, bytes([_WAIT_CANCELED]))
        else:
            raise _Broken(f"command {command}")

    def _send_blob(self, client: _Client, value: bytes) -> None:
        self._send(client, _U64.pack(len(value)) + value)

    def _forget_wait(self, client: _Client) -> None:
        for key in client.waiting:
            waiting = self._waiters.get(key)
            if waiting is not None:
                waiting.discard(client)
                if not waiting:
                    del self._waiters[key]
        client.waiting = set()

    def _store(self, key: str, value: bytes) -> None:
        self.values[key] = bytearray(value)
        self._wake(key)

    def _wake(self, key: str) -> None:
        for client in self._waiters.pop(key, ()):
            client.waiting.discard(key)
            if not client.waiting and client.sock.fileno() >= 0:
                self._send(client, bytes([_STOP_WAITING]))
