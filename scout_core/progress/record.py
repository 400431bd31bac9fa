"""The per-rank shared-memory progress record (paper sections 7 and 9).

The trainer publishes where it is; its out-of-band observer reads it. The
record is a small file in ``/dev/shm`` mapped by both processes:

* owner-only permissions (0600), created with ``O_EXCL``;
* torn-read safe on any memory model: a sequence lock (the writer makes the
  sequence odd, writes the fields, then makes it even again; a reader retries
  until it sees the same even sequence before and after copying the fields)
  plus a CRC-32 of the fields and the fingerprint that the reader validates.
  The sequence lock alone relies on the stores becoming visible in program
  order, which x86 gives and Arm does not (Python issues no fences); a reader
  that sees a stale field under a fresh even sequence finds the CRC wrong and
  retries;
* removed at exit by the trainer (``atexit``) or by its observer when the
  trainer is gone; a segment whose owner process no longer exists is reclaimed
  by the next :func:`create_record` on the machine.

Publishing is one ``struct.pack`` for the fields, a CRC-32 over them and two
``pack_into`` for the sequence (about a microsecond in CPython). A collective's
fingerprint is written only when the published one changes.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import mmap
import os
import re
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["pid_alive", "Phase", "ProgressRecord", "ProgressSnapshot", "create_record", "reclaim_stale", "SHM_DIR"]

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
_PREFIX = "scout-progress"
_NAME_RE = re.compile(rf"^{_PREFIX}-(?P<run>[A-Za-z0-9_.-]+)-r(?P<rank>\d+)-p(?P<pid>\d+)$")

# seq | step | op_id | launched | phase | pending | t_publish | t_phase | gap_max | fp_hash | fp_len | owner pid | crc32
_HEAD = struct.Struct("<QqqqIIdddQIII")
_SEQ = struct.Struct("<Q")
_BODY = struct.Struct("<qqqIIdddQII")  # the fields: _HEAD without the sequence and the CRC, at offset 8
_CRC = struct.Struct("<I")
_CRC_AT = 8 + _BODY.size  # CRC-32 of the fingerprint bytes, then of the fields
_FP_MAX = 448
_BUSY_AT = _HEAD.size + _FP_MAX
"""One byte the OBSERVER writes (the rest is the trainer's): 1 while it is inside an episode or the delivery of
its verdict, so that the trainer's close() waits for it to finish instead of killing it half-way."""
_LIVE_AT = _BUSY_AT + 1
"""Two bytes the TRAINER writes after the observer was forked: live settings the observer acts on (``scout ctl
set actions.on_verdict=...`` / ``report.log_level=...``): 0 = as configured at ``enable()``, else the new value."""
SIZE = _BUSY_AT + 8
_ON_VERDICT = ("log", "stop")


class Phase(enum.IntEnum):
    """What the trainer was doing at its last published point."""

    STARTING = 0
    FORWARD = 1
    BACKWARD = 2
    OPTIMIZER = 3
    DATALOADER = 4
    CHECKPOINT_READ = 5
    CHECKPOINT_WRITE = 6
    COLLECTIVE = 7
    STEP_END = 8
    COMPUTE = 9  # between hooks (returned from a data or checkpoint phase)
    CLOSED = 10  # the trainer closed SCOUT: its observer ends without a last episode


DDP_REDUCTION = "ddp_gradient_reduction"
"""The collective a DDP backward pass is published as when its buckets are not (:mod:`~scout_core.progress.
ddp_backward`); here, torch-free, because the observer's classification reads it too."""

_IO_PHASES = frozenset({Phase.DATALOADER, Phase.CHECKPOINT_READ, Phase.CHECKPOINT_WRITE})


@dataclass(frozen=True)
class ProgressSnapshot:
    """One consistent read of a record."""

    seq: int
    step: int
    op_id: int
    """Index (within ``step``) of the oldest launched-but-incomplete collective while ``pending``, else of
    the last collective launched: the rank's point in its step's collective sequence."""
    launched: int
    """Collectives launched so far in ``step`` (equal to ``op_id`` unless older ones are still in flight)."""
    phase: Phase
    pending: bool
    """True while a collective this rank launched has not completed."""
    t_publish: float
    """``time.monotonic()`` of the last publish (system-wide clock on Linux)."""
    t_phase: float
    """``time.monotonic()`` when the current phase began."""
    gap_max: float
    """Longest healthy interval between two publishes, over the completed steps since the first one; 0.0
    until the second step completes (the warm-up). The observer's adaptive threshold is derived from it."""
    fp_hash: int
    fingerprint: str
    """Fingerprint of the collective at ``op_id`` (the one the rank waits in while ``pending``)."""
    owner_pid: int

    @property
    def coordinate(self) -> tuple[int, int, int]:
        """Total order of progress: waiting in collective i < done with i < waiting in i + 1."""
        return (self.step, self.op_id, 0 if self.pending else 1)


class ProgressRecord:
    """A mapped record; the owner writes, observers read."""

    def __init__(self, path: str, *, owner: bool) -> None:
        self.path = path
        self.owner = owner
        flags = os.O_RDWR
        fd = os.open(path, flags)
        try:
            self._mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._seq = 0
        self._phase = Phase.STARTING
        self._t_phase = time.monotonic()
        self._fp_hash = 0
        self._fp_len = 0
        self._fp_crc = zlib.crc32(b"")
        self._pid = os.getpid()
        self._t_last = self._t_phase
        self._gap_max = 0.0  # published: committed at step ends
        self._gap_seen = 0.0  # learned in the current step
        self.learning = False
        """Set by the tracker once the warm-up step is over: from then on gaps between publishes count."""
        self.learn_below: Callable[[float], float] = lambda published: float("inf")
        """Given the published gap, the silence threshold in force: longer gaps were stalls (a verdict may have
        named them) and are not learned as healthy."""

    # -- writer ------------------------------------------------------------------------------

    def publish(self, step: int, op_id: int, phase: Phase, pending: bool = False, launched: int | None = None,
                fp: tuple[int, str] | None = None) -> None:
        """Publish a point; ``fp`` = ``(hash, text)`` replaces the fingerprint, None keeps the last one."""
        now = time.monotonic()
        gap = now - self._t_last
        self._t_last = now
        # A gap spent in a data-loader fetch or checkpoint I/O is judged by its own tolerance, not learned.
        if self.learning and gap > self._gap_seen and self._phase not in _IO_PHASES \
                and gap < self.learn_below(self._gap_max):
            self._gap_seen = gap
        if phase != self._phase:
            self._phase = phase
            self._t_phase = now
        data = None
        if fp is not None and fp[0] != self._fp_hash:
            data = fp[1].encode()[:_FP_MAX]
            self._fp_hash, self._fp_len, self._fp_crc = fp[0], len(data), zlib.crc32(data)
        body = _BODY.pack(step, op_id, op_id if launched is None else launched, phase, pending, now, self._t_phase,
                          self._gap_max, self._fp_hash, self._fp_len, self._pid)
        # Sequence odd first, fields, then even: a memcpy may store bytes in any
        # order, so the odd marker must land before any field changes.
        _SEQ.pack_into(self._mm, 0, self._seq + 1)
        if data is not None:
            self._mm[_HEAD.size : _HEAD.size + len(data)] = data
        self._mm[8:_CRC_AT] = body
        _CRC.pack_into(self._mm, _CRC_AT, zlib.crc32(body, self._fp_crc))
        self._seq += 2
        _SEQ.pack_into(self._mm, 0, self._seq)

    def commit_gaps(self) -> None:
        """A step completed: its healthy gaps become part of the published rhythm (from the next publish)."""
        if self.learning:
            self._gap_max = max(self._gap_max, self._gap_seen)

    @property
    def last_publish(self) -> float:
        """``time.monotonic()`` of this writer's last publish."""
        return self._t_last

    # -- reader ------------------------------------------------------------------------------

    def read(self, timeout_s: float = 1.0) -> ProgressSnapshot:
        deadline = None
        attempt = 0
        while True:
            attempt += 1
            if attempt % 64 == 0:
                # A writer publishing back to back can starve us: yield, and give up
                # only after a wall-clock bound rather than a retry count.
                deadline = deadline or time.monotonic() + timeout_s
                if time.monotonic() > deadline:
                    raise RuntimeError(f"progress record {self.path} kept changing for {timeout_s}s")
                time.sleep(0)
            head = self._mm[: _HEAD.size]
            seq = _SEQ.unpack_from(head)[0]
            if seq & 1:
                continue
            fields = _HEAD.unpack(head)
            fp = bytes(self._mm[_HEAD.size : _HEAD.size + min(fields[10], _FP_MAX)])
            if _SEQ.unpack_from(self._mm, 0)[0] != seq:
                continue  # the writer moved on while we copied: torn, retry
            if seq and zlib.crc32(head[8:_CRC_AT], zlib.crc32(fp)) != fields[12]:
                continue  # a field not yet visible although the sequence is (weak memory order): retry
            _, step, op_id, launched, phase, pending, t_pub, t_phase, gap_max, fp_hash, _, pid, _ = fields
            return ProgressSnapshot(seq, step, op_id, launched, Phase(phase), bool(pending), t_pub, t_phase,
                                    gap_max, fp_hash, fp.decode(errors="replace"), pid)

    # -- the observer's byte -------------------------------------------------------------------

    def set_observer_busy(self, busy: bool) -> None:
        self._mm[_BUSY_AT] = 1 if busy else 0

    @property
    def observer_busy(self) -> bool:
        """The observer is inside an episode (a single byte: no tearing, no ordering to rely on)."""
        return self._mm[_BUSY_AT] == 1

    # -- the trainer's live settings ---------------------------------------------------------------

    def set_live(self, *, on_verdict: str | None = None, log_level: int | None = None) -> None:
        """Publish a live change of ``actions.on_verdict`` or of the log level (a ``logging`` number)."""
        if on_verdict is not None:
            self._mm[_LIVE_AT] = 1 + _ON_VERDICT.index(on_verdict)
        if log_level is not None:
            self._mm[_LIVE_AT + 1] = max(1, min(255, int(log_level)))

    def live(self) -> tuple[str | None, int | None]:
        """``(actions.on_verdict, log level)`` as the trainer changed them live; None: as configured (single
        bytes: no tearing)."""
        verdict, level = self._mm[_LIVE_AT], self._mm[_LIVE_AT + 1]
        return (_ON_VERDICT[verdict - 1] if 0 < verdict <= len(_ON_VERDICT) else None), (level or None)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._mm.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a zombie never publishes again)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def reclaim_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink records of this user whose owner process is gone; return their paths."""
    removed = []
    uid = os.getuid()
    for name in os.listdir(directory):
        m = _NAME_RE.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != uid or pid_alive(int(m["pid"])):
                continue
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            continue
    return removed


def create_record(run_id: str, rank: int, directory: str = SHM_DIR) -> ProgressRecord:
    """Create this process's record (0600, exclusive) and arrange its removal at exit."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", run_id):
        raise ValueError(f"run_id {run_id!r} may only contain letters, digits, '_', '.', '-'")
    reclaim_stale(directory)
    path = os.path.join(directory, f"{_PREFIX}-{run_id}-r{rank}-p{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, SIZE)
    finally:
        os.close(fd)
    record = ProgressRecord(path, owner=True)
    record.publish(0, 0, Phase.STARTING)
    pid = os.getpid()

    def _cleanup() -> None:
        if os.getpid() == pid:  # not in forked children (the observer unlinks on its own)
            record.unlink()

    atexit.register(_cleanup)
    return record
