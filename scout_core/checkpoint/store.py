"""Durable checkpoint store: per-rank shards plus status sidecars, crash-safe.

Layout::

    ROOT/gen-000000012/rank-00003.pt     the shard (torch.save of plain tensors and containers)
    ROOT/gen-000000012/rank-00003.json   its sidecar: generation, rank, world size, role, sha256, bytes

Every file is written to a temporary name in the same directory, fsync'ed,
renamed over its final name, and the directory is fsync'ed. The sidecar is
written only after its shard is durable, so a sidecar is the commit record: a
writer killed at any point leaves either no sidecar (the shard is ignored) or a
complete shard whose checksum the sidecar carries. A shard is selectable only
when its sidecar parses and its bytes hash to the recorded sha256. Loading uses
``torch.load(weights_only=True)``.

Generations are chosen by a rank-consistency vote (:func:`agree_on_generation`):
the newest generation that EVERY rank can load in the requested role.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from scout_core.durable_files import (
    HashingFile,
    atomic_stream,
    atomic_write,
    fsync_dir,
    remove_stale_temporaries,
)
from scout_core.wire import all_gather_data

__all__ = ["DurableStore", "ROLES", "agree_on_generation", "atomic_save", "atomic_stream", "atomic_write",
           "remove_stale_temporaries"]

ROLES = ("candidate", "verified")
_GEN_RE = re.compile(r"^gen-(\d{9})$")


def atomic_save(path: str, obj: Any) -> tuple[str | None, int]:
    """``torch.save`` straight into a file, crash-safely (see :func:`atomic_stream`)."""
    return atomic_stream(path, lambda out: torch.save(obj, out))


def _copy_file(source: str) -> Callable[[HashingFile], None]:
    def emit(out: HashingFile) -> None:
        with open(source, "rb") as fh:
            while chunk := fh.read(1 << 22):
                out.write(chunk)

    return emit


class DurableStore:
    """One rank's view of the store."""

    def __init__(self, root: str | os.PathLike[str], rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        self.root = os.fspath(root)
        self.rank = rank
        self.world_size = world_size
        os.makedirs(self.root, exist_ok=True)
        for gen in self._generation_dirs():  # this rank's own leftovers only: the store is shared by machines
            remove_stale_temporaries(self._gen_dir(gen), prefix=f"rank-{rank:05d}")

    def _gen_dir(self, generation: int) -> str:
        if generation < 0:
            raise ValueError(f"generation must be >= 0, got {generation}")
        return os.path.join(self.root, f"gen-{generation:09d}")

    def _paths(self, generation: int, rank: int | None = None) -> tuple[str, str]:
        base = os.path.join(self._gen_dir(generation), f"rank-{self.rank if rank is None else rank:05d}")
        return base + ".pt", base + ".json"

    # -- writing ------------------------------------------------------------------------------

    def write(self, generation: int, state: dict[str, Any], role: str = "candidate") -> str:
        """Persist this rank's shard of ``generation`` crash-safely; return the shard path."""
        return self._commit(generation, role, lambda out: torch.save(state, out))

    def write_file(self, generation: int, source: str, role: str = "candidate") -> str:
        """Persist an already serialized shard (the in-memory slot file) by streaming its bytes: no second
        serialization and no host copy of the state. Same crash safety as :meth:`write`."""
        return self._commit(generation, role, _copy_file(source))

    def _commit(self, generation: int, role: str, emit: Callable[[HashingFile], None]) -> str:
        """The shard first (temporary name, fsync, rename), then its sidecar: the sidecar is the commit."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        directory = self._gen_dir(generation)
        os.makedirs(directory, exist_ok=True)
        fsync_dir(self.root)
        shard, sidecar = self._paths(generation)
        if os.path.exists(sidecar):
            # An older commit of this generation (an earlier run's, kept for forensics): if this write fails, that
            # shard must not stay selectable beside the other ranks' new ones.
            os.unlink(sidecar)
            fsync_dir(directory)
        sha, size = atomic_stream(shard, emit, digest=True)
        meta = {"generation": generation, "rank": self.rank, "world_size": self.world_size, "role": role,
                "sha256": sha, "bytes": size, "time_unix": time.time()}
        atomic_write(sidecar, json.dumps(meta, sort_keys=True).encode())
        return shard

    def set_role(self, generation: int, role: str) -> None:
        """Change this rank's recorded role of a generation (e.g. candidate -> verified), atomically."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        meta = self._sidecar(generation)
        if meta is None:
            raise FileNotFoundError(f"rank {self.rank} holds no committed shard of generation {generation}")
        meta["role"] = role
        atomic_write(self._paths(generation)[1], json.dumps(meta, sort_keys=True).encode())

    def remove(self, generation: int) -> None:
        """Remove this rank's shard and sidecar of ``generation`` (the directory once every rank did)."""
        for path in self._paths(generation):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(self._gen_dir(generation))

    def prune(self, keep: set[int]) -> None:
        """Remove this rank's files of every generation not in ``keep`` (and empty generation dirs)."""
        for gen in list(self._generation_dirs()):
            if gen in keep:
                continue
            for path in self._paths(gen):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            with contextlib.suppress(OSError):
                os.rmdir(self._gen_dir(gen))  # only succeeds once every rank pruned it

    # -- reading ------------------------------------------------------------------------------

    def _generation_dirs(self) -> Iterator[int]:
        for name in sorted(os.listdir(self.root)):
            m = _GEN_RE.match(name)
            if m:
                yield int(m.group(1))

    def _sidecar(self, generation: int, rank: int | None = None) -> dict[str, Any] | None:
        try:
            with open(self._paths(generation, rank)[1], "rb") as fh:
                meta = json.loads(fh.read())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return None
        # A sidecar of another shape (torn, foreign, edited) is a shard not committed, never an error.
        if not isinstance(meta, dict) or meta.get("generation") != generation \
                or meta.get("world_size") != self.world_size or not isinstance(meta.get("bytes"), int) \
                or not isinstance(meta.get("sha256"), str) or not isinstance(meta.get("role"), str):
            return None
        return meta

    def _verified_bytes(self, generation: int) -> bytes | None:
        meta = self._sidecar(generation)
        if meta is None:
            return None
        try:
            with open(self._paths(generation)[0], "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return None
        if len(data) != meta["bytes"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
            return None
        return data

    def local_generations(self, *, check_bytes: bool = True) -> dict[int, str]:
        """Generation -> role for every shard of this rank that is committed (and intact)."""
        out = {}
        for gen in self._generation_dirs():
            meta = self._sidecar(gen)
            if meta is None:
                continue
            if check_bytes and self._verified_bytes(gen) is None:
                continue
            out[gen] = meta["role"]
        return out

    def load(self, generation: int) -> dict[str, Any]:
        """This rank's shard of ``generation``, checksum-verified, loaded with ``weights_only=True``."""
        data = self._verified_bytes(generation)
        if data is None:
            raise FileNotFoundError(f"rank {self.rank}: generation {generation} is missing or corrupt")
        return torch.load(io.BytesIO(data), weights_only=True)

    def remove_all(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def agree_on_generation(store: DurableStore, role: str | None = None, group: Any = None) -> int | None:
    """The newest generation every rank holds intact (in ``role``, when given); one all-gather.

    Returns ``None`` when no generation is held by every rank. Every rank gets
    the same answer.
    """

    mine = store.local_generations()
    if role is not None:
        mine = {g: r for g, r in mine.items() if r == role}
    everyone = all_gather_data(sorted(mine), group, what="snapshot generations")
    common = set(everyone[0])
    for gens in everyone[1:]:
        common &= set(gens)
    return max(common) if common else None
