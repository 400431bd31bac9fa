"""Crash-safe files without torch: write to a temporary, fsync, rename, fsync the folder.

The checkpoint store (:mod:`scout_core.checkpoint.store`) streams tensors through these; the observer, which runs
without torch, writes the hosts file with them (:func:`scout_core.actions.record_exclusions`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from collections.abc import Callable

__all__ = ["STALE_TMP_S", "HashingFile", "atomic_stream", "atomic_write", "fsync_dir", "remove_stale_temporaries"]


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingFile:
    """A write-only file object (torch.save streams into it) that hashes what passes through, if asked."""

    def __init__(self, fd: int, digest: bool) -> None:
        self.fd, self.sha, self.bytes = fd, hashlib.sha256() if digest else None, 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        if self.sha is not None:
            self.sha.update(view)
        self.bytes += len(view)
        while view:
            view = view[os.write(self.fd, view):]
        return self.bytes

    def flush(self) -> None:
        pass


def atomic_stream(path: str, emit: Callable[[HashingFile], None], *,
                  digest: bool = False) -> tuple[str | None, int]:
    """Write what ``emit`` streams into a temporary file, fsync, rename, fsync the directory.

    No serialized copy is held in memory. Returns (sha256 if ``digest`` else None, bytes): only the
    durable store keeps a checksum, and hashing a whole state costs a core for a second per GB or so,
    so slots and replicas are not hashed. A failure removes the temporary
    file; one left by a killed process is removed by :func:`remove_stale_temporaries` at the next start.
    """
    directory = os.path.dirname(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            out = HashingFile(fd, digest)
            emit(out)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)
    return (out.sha.hexdigest() if out.sha is not None else None), out.bytes


_TMP = re.compile(r".+\.tmp-(\d+)$")
STALE_TMP_S = 60.0
"""A temporary file untouched this long whose writer process is gone is a leftover of a killed writer."""


def remove_stale_temporaries(directory: str, prefix: str = "") -> list[str]:
    """Delete the temporaries that killed writers left in ``directory`` (RAM-backed ones hold memory).

    A file is stale when the process id in its name is not running on this machine and it has not been
    written to for ``STALE_TMP_S``: a writer in another PID namespace sharing the folder keeps writing,
    so its file stays fresh and is left alone.
    """
    gone = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return gone
    now = time.time()
    for name in names:
        m = _TMP.match(name)
        if not m or not name.startswith(prefix):
            continue
        path = os.path.join(directory, name)
        try:
            os.kill(int(m.group(1)), 0)
            continue  # the writer is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        with contextlib.suppress(FileNotFoundError):
            if now - os.path.getmtime(path) >= STALE_TMP_S:
                os.unlink(path)
                gone.append(name)
    return gone


def atomic_write(path: str, data: bytes | memoryview) -> None:
    """``data`` into ``path``, crash-safely (see :func:`atomic_stream`)."""
    atomic_stream(path, lambda out: out.write(data))
