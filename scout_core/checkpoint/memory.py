"""In-memory snapshot slots: RAM-backed files, one folder per machine, that outlive the trainer.

Layout (``ROOT`` is ``checkpoint.memory_dir``, default ``/dev/shm/scout-<uid>-<job>``)::

    ROOT/<host>/own-r00003-s000000040-w00016-j<id>.pt       rank 3's newest snapshot (step 40) of a 16-rank job
    ROOT/<host>/replica-r00011-s000000040-w00016-j<id>.pt   rank 11's snapshot, kept here by its partner

Step, world size and job are in the name, so a restarted job takes inventory
without reading a byte, and slots of a job of another size, or of another job,
are never offered. The job (``<id>``, :func:`job_token`) hashes ``report.run_id``
(else the launcher's job id) with the nonce of the checkpoint folder, which rank 0
reads or creates at ``enable()`` and sends to every rank (:func:`share_nonce`): a
folder made afresh never restores an older job's memory. Slots of another job are
left out of every inventory and deleted at this job's first capture
(:meth:`MemorySlots.drop_foreign`). A slot is
written to a temporary name and renamed (a reader never sees a partial slot),
then the older slot of the same owner is removed: at rest a rank holds one own
slot plus one replica slot per rank it partners.

Before the first capture :meth:`MemorySlots.ensure_space` checks the free space
of the RAM-backed filesystem (containers often mount a 64 MB ``/dev/shm``); if
it cannot hold the slots, snapshots fall back to ``<checkpoint.directory>/memory``
on disk, with a warning, rather than failing mid-run.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from scout_core.checkpoint.store import atomic_save, atomic_write, fsync_dir, remove_stale_temporaries
from scout_core.private_dir import private_dir
from scout_core.wire import broadcast_data

__all__ = ["NONCE", "MemorySlots", "default_memory_root", "job_token", "partners", "read_nonce", "share_nonce",
           "write_nonce"]

_log = logging.getLogger("scout")
_SLOT = re.compile(r"^(own|replica)-r(\d{5})-s(\d{9})-w(\d{5})(?:-j([0-9a-f]{12}))?\.pt$")
_MARKER = re.compile(r"^machine-r(\d{5})$")
"""The boot id of the machine that wrote a rank's slots in this folder (see :meth:`MemorySlots.inventory`)."""
_NONCE = re.compile(r"^[0-9a-f]{32}$")
NONCE = "job-nonce"
"""The file in the checkpoint folder that names this folder's incarnation (written once, at ``enable()``)."""
HEADROOM = 1.10
"""Free space asked for beyond the slots' size (serialization overhead, a transient second slot)."""


def default_memory_root(directory: str, memory_dir: str = "") -> str:
    """Where a job's slots live: stable across restarts of the same job (keyed by its durable directory)."""
    base = memory_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    job = hashlib.sha1(os.path.abspath(directory).encode()).hexdigest()[:12]
    # The user in the name: another user who made this job's folder first cannot keep it from starting.
    return os.path.join(base, f"scout-{os.geteuid()}-{job}")


def read_nonce(folder: str) -> str | None:
    """The nonce of the checkpoint ``folder`` (None: it has none); a file that is not a nonce raises."""
    try:
        with open(os.path.join(folder, NONCE), encoding="ascii", errors="replace") as fh:
            nonce = fh.read().strip()
    except FileNotFoundError:
        return None
    if not _NONCE.match(nonce):
        raise ValueError(f"{os.path.join(folder, NONCE)} holds no job nonce ({nonce[:40]!r})")
    return nonce


def write_nonce(folder: str, nonce: str) -> bool:
    """Write ``nonce`` into ``folder`` unless it holds one already (True: written here). A fsynced temporary
    (``mkstemp``: unique on every machine) hard-linked to the final name, so a nonce there is never replaced; a
    file system without hard links (gcsfuse, s3fs) gets a rename, and every writer writes the same value."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, NONCE)
    if os.path.exists(path):
        return False
    fd, tmp = tempfile.mkstemp(prefix=f"{NONCE}.tmp-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(nonce)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # no hard links here
            if os.path.exists(path):
                return False
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(folder)
    return True


def share_nonce(folder: str, *, rank: int, group: Any, on_error: Callable[[BaseException], None]) -> tuple[str, bool]:
    """The job's nonce (every rank calls it, at ``enable()``): rank 0 reads or creates the one of its checkpoint
    folder and broadcasts it on ``group``; a rank whose folder lacks it (a node-local folder) writes it there.
    Also whether rank 0 made it now (the folder had none). A rank that fails reports it through ``on_error``:
    rank 0 then sends a nonce of this launch alone (its slots are never restored, nothing is mislabelled)."""
    box: list[Any] = [None]
    if rank == 0:
        made = False
        try:
            nonce = read_nonce(folder)
            if nonce is None:
                made = True
                write_nonce(folder, uuid.uuid4().hex)
                nonce = read_nonce(folder)
                if nonce is None:
                    raise FileNotFoundError(f"{os.path.join(folder, NONCE)} is not visible after it was written")
            box[0] = (nonce, made, True)
        except Exception as exc:  # noqa: BLE001 - every rank goes on with a nonce of this launch
            on_error(exc)
            box[0] = (uuid.uuid4().hex, made, False)
    nonce, made, kept = broadcast_data(box[0], 0, group, what="snapshot nonce")
    if rank != 0 and kept:
        try:
            write_nonce(folder, nonce)  # only where absent: a node-local folder
        except Exception as exc:  # noqa: BLE001 - bookkeeping of this rank alone: the nonce is agreed already
            on_error(exc)
    return nonce, made


def job_token(job: str, nonce: str) -> str:
    """The job's mark in slot names: ``job`` (the run id or the launcher's job id) with the folder's nonce."""
    return hashlib.sha1(f"{job}\n{nonce}".encode()).hexdigest()[:12]


def partners(hosts: Mapping[int, str]) -> dict[int, int]:
    """rank -> the rank that keeps its replica: same local index on the next machine.

    Works for any world size and uneven machines (indices wrap). On a single
    machine the partner is the next rank, which covers process loss only.
    """
    by_host: dict[str, list[int]] = {}
    for r in sorted(hosts):
        by_host.setdefault(hosts[r], []).append(r)
    names = sorted(by_host)
    out = {}
    if len(names) == 1:
        ranks = by_host[names[0]]
        return {r: ranks[(i + 1) % len(ranks)] for i, r in enumerate(ranks)} if len(ranks) > 1 else {}
    for h, name in enumerate(names):
        nxt = by_host[names[(h + 1) % len(names)]]
        for i, r in enumerate(by_host[name]):
            out[r] = nxt[i % len(nxt)]
    return out


class MemorySlots:
    """One rank's slots on its machine."""

    def __init__(self, root: str, *, rank: int, hosts: Mapping[int, str], fallback: str, token: str = "",
                 fresh: bool = False) -> None:
        """``token``: this job's mark in slot names (:func:`job_token`; "": none); ``fresh``: the checkpoint
        folder had no nonce (it was made afresh), which says why slots of another job are here."""
        self.rank = rank
        self.token = token
        self.hosts = dict(hosts)
        self.world = len(hosts)
        self.host = _safe(hosts[rank])
        self.local_ranks = sum(1 for h in hosts.values() if h == hosts[rank])
        self.root = root
        self.fallback = fallback
        self.fell_back = ""
        self._make_dirs()
        self.machine = machine_identity()
        self.written_on = self._read_marker()  # the boot this rank's own slots were written on, before any write
        self._marked = False
        for d in self._dirs():  # a writer killed mid-slot left its temporary behind, holding RAM
            remove_stale_temporaries(d)
        self._drop_other_world_sizes()
        lead = self.rank == min(r for r, h in self.hosts.items() if h == hosts[rank])  # counts for the machine
        found = sum(1 for _ in self._foreign()) if lead else 0
        why = ("the checkpoint folder had no job nonce: it was made afresh" if fresh else
               "they carry another job's identity (report.run_id, the launcher's job id or the checkpoint folder's "
               "nonce differ)")
        self.foreign: tuple[int, str] = (found, why if found else "")
        """Slots of another job on this machine (counted by its lowest rank; never offered, deleted at this job's
        first capture), and why."""

    def _drop_other_world_sizes(self) -> None:
        """Slots of this job's earlier incarnation at another world size: no resume of this size can use
        them (shards differ), and on a RAM-backed filesystem they would hold memory for good. Also the boot
        markers of ranks no longer on this machine (their slots went with them)."""
        here = {r for r, h in self.hosts.items() if _safe(h) == self.host}
        for d in self._dirs():
            with contextlib.suppress(OSError):
                for n in os.listdir(d):
                    m = _MARKER.match(n)
                    if m and int(m.group(1)) not in here:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(d, n))
        for d, n, m in self._slot_files():
            if (m.group(5) or "") == self.token and int(m.group(4)) != self.world:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(d, n))
                    _log.warning("rank %d: deleted %s, a snapshot of this job at world size %d (now %d)",
                                 self.rank, n, int(m.group(4)), self.world)

    def _foreign(self) -> Iterator[str]:
        for d, n, m in self._slot_files():
            if (m.group(5) or "") != self.token:
                yield os.path.join(d, n)

    def drop_foreign(self) -> int:
        """Delete the slots of another job on this machine, which on a RAM-backed filesystem would hold memory
        for good; only once every rank agreed this job goes on (its first capture): how many went."""
        gone = 0
        for path in list(self._foreign()):
            try:
                os.unlink(path)
                gone += 1
            except FileNotFoundError:  # a rank of this machine deleted it meanwhile
                continue
            except OSError as exc:  # it holds memory, nothing else: the capture goes on
                _log.warning("rank %d: could not delete %s, a snapshot of another job: %s", self.rank, path, exc)
        if gone:
            _log.warning("rank %d: deleted %d in-memory snapshot(s) of another job: %s", self.rank, gone,
                         self.foreign[1] or "they carry another job's identity")
        return gone

    @property
    def dir(self) -> str:
        return os.path.join(self.root, self.host)

    def _slot_files(self) -> Iterator[tuple[str, str, re.Match[str]]]:
        """(folder, file name, name match) of every slot file on this machine, of a job of any size."""
        for d in self._dirs():
            try:
                names = os.listdir(d)
            except FileNotFoundError:  # a peer removed that (emptied) directory meanwhile
                continue
            for n in names:
                m = _SLOT.match(n)
                if m:
                    yield d, n, m

    def _dirs(self) -> list[str]:
        """Where slots of this machine may be: the RAM-backed folder and the disk fallback (a previous run
        of the job may have fallen back)."""
        out = []
        for root in dict.fromkeys((self.root, self.fallback)):
            d = os.path.join(root, self.host)
            if os.path.isdir(d):
                out.append(d)
        return out

    # -- space ---------------------------------------------------------------------------------

    def ensure_space(self, state_bytes: int, copies: int) -> None:
        """Fall back to disk (and say so) when the RAM-backed filesystem cannot hold the machine's slots.

        Every rank of the machine writes into the same filesystem, so the need is counted for all of them
        (``copies`` slots each, this rank's state size standing for theirs); slots already held are
        replaced, so they count as free. Slots of another job go first (:meth:`drop_foreign`).
        """
        self.drop_foreign()
        need = int(state_bytes * copies * self.local_ranks * HEADROOM)
        st = os.statvfs(self.dir)
        free = st.f_bavail * st.f_frsize + self._held_bytes()
        if need <= free:
            return
        self.fell_back = (f"{self.dir} has {free / 2**20:.1f} MiB free, the in-memory snapshots of this machine's "
                          f"{self.local_ranks} rank(s) need {need / 2**20:.1f} MiB ({copies} x "
                          f"{state_bytes / 2**20:.1f} MiB state each); using {self.fallback} on disk instead "
                          "(mount a larger /dev/shm or set checkpoint.memory_dir)")
        _log.warning("rank %d: %s", self.rank, self.fell_back)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.dir, self._marker()))  # its slots are written on disk from now on
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)  # nothing of ours is left in the small filesystem
        self.root = self.fallback
        self._make_dirs()

    def _make_dirs(self) -> None:
        """The root and this machine's folder, owner-only and this user's (another user of the machine could
        otherwise plant a slot that a restart restores)."""
        private_dir(self.root, "checkpoint.memory_dir")
        private_dir(self.dir, "checkpoint.memory_dir")

    def _held_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.dir, n)) for n in os.listdir(self.dir) if _SLOT.match(n))

    # -- writing -------------------------------------------------------------------------------

    def _name(self, kind: str, owner: int, step: int) -> str:
        return f"{kind}-r{owner:05d}-s{step:09d}-w{self.world:05d}{'-j' + self.token if self.token else ''}.pt"

    def _path(self, kind: str, owner: int, step: int) -> str:
        """Where a slot is (either folder)."""
        name = self._name(kind, owner, step)
        for d in self._dirs():
            if os.path.exists(os.path.join(d, name)):
                return os.path.join(d, name)
        return os.path.join(self.dir, name)

    def _marker(self) -> str:
        return f"machine-r{self.rank:05d}"  # matches _MARKER

    def _read_marker(self) -> str:
        for d in self._dirs():
            with contextlib.suppress(OSError, UnicodeDecodeError):
                with open(os.path.join(d, self._marker()), encoding="ascii") as fh:
                    return fh.read().strip()
        return ""

    def write_own(self, snap: dict[str, Any]) -> str:
        path = os.path.join(self.dir, self._name("own", self.rank, int(snap["step"])))
        atomic_save(path, snap)
        if not self._marked and self.machine:  # once per process, after its first slot: where they are written
            try:
                atomic_write(os.path.join(self.dir, self._marker()), self.machine.encode("ascii"))
                self._marked, self.written_on = True, self.machine
            except OSError as exc:  # the slot is good; a restart elsewhere may then not know it moved
                _log.warning("rank %d: could not write %s beside its snapshot: %s", self.rank, self._marker(), exc)
        self._drop_older("own", self.rank, path)
        return path

    def write_replica(self, owner: int, step: int, data: torch.Tensor) -> str:
        """Keep ``owner``'s serialized slot of ``step`` (raw bytes as received)."""
        path = os.path.join(self.dir, self._name("replica", owner, step))
        atomic_write(path, memoryview(data.numpy()))
        self._drop_older("replica", owner, path)
        return path

    def _drop_older(self, kind: str, owner: int, keep: str) -> None:
        for path, (k, o, _) in self._all_slots().items():
            if k == kind and o == owner and path != keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    # -- reading -------------------------------------------------------------------------------

    def _all_slots(self) -> dict[str, tuple[str, int, int]]:
        """Path -> (kind, owner, step) of every complete slot of this job at this size on this machine."""
        return {os.path.join(d, n): (m.group(1), int(m.group(2)), int(m.group(3))) for d, n, m in self._slot_files()
                if int(m.group(4)) == self.world and (m.group(5) or "") == self.token}

    def slots(self) -> dict[str, tuple[str, int, int]]:
        """File name -> (kind, owner, step) of every complete slot on this machine."""
        return {os.path.basename(p): v for p, v in self._all_slots().items()}

    def inventory(self) -> dict[str, Any]:
        """What this rank can offer: its own step and the replicas it keeps {owner: step}."""
        own = [s for k, o, s in self.slots().values() if k == "own" and o == self.rank]
        replicas = {o: s for k, o, s in self.slots().values() if k == "replica"}
        out: dict[str, Any] = {"own": max(own) if own else None, "replicas": replicas}
        if own and self.written_on and self.machine and self.written_on != self.machine:
            # Written on another machine (a rescheduled pod that kept its hostname, a shared disk fallback) or
            # before a reboot: restorable, but what the machine that wrote it computed cannot be swept here.
            out["moved"] = True
        return out

    def path_of(self, kind: str, owner: int, step: int) -> str:
        return self._path(kind, owner, step)

    def load(self, kind: str, owner: int, step: int) -> dict[str, Any]:
        return torch.load(self._path(kind, owner, step), weights_only=True)

    def raw(self, kind: str, owner: int, step: int) -> torch.Tensor:
        path = self._path(kind, owner, step)
        return torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)

    def drop_newer(self, step: int, replica_owners: Iterable[int]) -> list[str]:
        """Delete this rank's slot and the replicas it keeps if they are newer than ``step``: after a
        resume from an older generation they hold the state that was judged unsafe, and a second restart
        must not find them as ``latest``. Returns the deleted file names."""
        owners, gone = set(replica_owners), []
        for path, (kind, owner, slot_step) in self._all_slots().items():
            mine = (kind == "own" and owner == self.rank) or (kind == "replica" and owner in owners)
            if mine and slot_step > step:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    gone.append(os.path.basename(path))
        return gone

    def remove_mine(self, replica_owners: Iterable[int]) -> None:
        """Delete this rank's slot and the replicas it keeps; folders go once empty. Other ranks of the
        machine share the folder and may still be writing: their slots are theirs to delete."""
        owners = set(replica_owners)
        for path, (kind, owner, _) in self._all_slots().items():
            if (kind == "own" and owner == self.rank) or (kind == "replica" and owner in owners):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        for d in self._dirs():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, self._marker()))
        for d in self._dirs():
            with contextlib.suppress(OSError):
                os.rmdir(d)
                os.rmdir(os.path.dirname(d))


def machine_identity() -> str:
    """This machine's boot, as the kernel names it (shared by every container on the machine, new after a reboot):
    a pod rescheduled onto another node keeps its hostname, not this. "" where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _safe(host: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", host) or "host"
