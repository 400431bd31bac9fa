"""What one hang episode costs the control plane at 1k, 10k and 100k ranks: an in-process simulation.

The real :class:`~scout_core.progress.episode.EpisodeProtocol` runs for every
simulated observer against a counting in-memory store (no processes, no
sockets): every observer posts, the first of each peer group leads it, the
first overall reports, everyone reads the verdict. Each store call is one
message (waits are served by the store: ``TCPStore.wait``, one request and
one answer, not a polling loop); bytes are keys plus values both ways. The job is a model-parallel
partition of ``mp`` ranks (tensor x pipeline) replicated ``world / mp`` times,
so a peer group (the replicas of one model-parallel position) has
``world / mp`` members. One rank is frozen; the rest wait.

    python benchmarks/scale_sim.py            # prints the table
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scout_core.progress.classify import Evidence  # noqa: E402
from scout_core.progress.episode import EpisodeProtocol  # noqa: E402

HEARTBEAT_CAP_PER_S = 20_000
"""The observer heartbeat is stretched to world_size / 20000 s on large jobs (ObserverConfig.heartbeat_s)."""


class CountingStore:
    """A dict with the TCPStore calls the protocol uses; counts messages and bytes per client."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.messages: dict[int, int] = defaultdict(int)
        self.bytes: dict[int, int] = defaultdict(int)
        self.client = -1

    def _count(self, *payload: Any) -> None:
        self.messages[self.client] += 1
        self.bytes[self.client] += sum(len(p) if isinstance(p, (str, bytes)) else 8 for p in payload)

    def set(self, key: str, value: str) -> None:
        self._count(key, value)
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        value = self.data[key]
        self._count(key, value)
        return value

    def check(self, keys: list[str]) -> bool:
        self._count(*keys)
        return all(k in self.data for k in keys)

    def add(self, key: str, amount: int) -> int:
        self._count(key)
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._count(key, expected, desired)
        current = self.data.get(key)
        if (current is None and expected == "") or current == expected.encode():
            self.data[key] = desired.encode()
            return desired.encode()
        return current if current is not None else expected.encode()

    def wait(self, keys: list[str], timeout: Any) -> None:
        """Served by the store: one request, one answer when the keys exist (the simulation runs in order, so
        a missing key means the wait would time out)."""
        from torch.distributed import DistStoreError

        self._count(*keys)
        if not all(k in self.data for k in keys):
            raise DistStoreError("timeout")

    def append(self, key: str, value: str) -> None:
        self._count(key, value)
        self.data[key] = self.data.get(key, b"") + value.encode()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = [self.data[k] for k in keys]
        self._count(*keys, *values)
        return values


def simulate(world: int, mp: int = 64, frozen: int = 9) -> dict[str, Any]:
    mp = min(mp, world)
    groups = [list(range(pos, world, mp)) for pos in range(mp)]  # replicas of each model-parallel position
    hosts = {r: f"node{r // 8}" for r in range(world)}
    store = CountingStore()
    clock = [0.0]
    observers = []
    for r in range(world):
        store.client = r
        observers.append(EpisodeProtocol(store, rank=r, peer_groups=groups, hosts=hosts, gather_timeout_s=10.0,
                                         heartbeat_s=max(1.0, world / HEARTBEAT_CAP_PER_S), clock=lambda: clock[0],
                                         gid=r % mp))
    for r in range(world):  # the set-up read is not part of the episode
        store.messages[r] = store.bytes[r] = 0
    start = time.perf_counter()
    order = [r for r in range(world) if r != frozen] + [frozen]  # the waiting ranks' observers post first
    first = order[0]
    store.client = first
    observers[first].open()
    starts, roles = {}, {}
    for r in order:
        store.client = r
        observers[r].opened()  # the heartbeat that finds the episode open
        fp = (0, 0) if r == frozen else (7, 1)
        mine = Evidence(rank=r, step=3, op_id=fp[1], phase=1 if r == frozen else 7, pending=r != frozen,
                        fp_hash=fp[0], fingerprint="" if r == frozen else "ddp_bucket_all_reduce", silent_s=6.0,
                        seq=100)
        starts[r] = observers[r].post(mine)
        roles[r] = observers[r].claim(0)
    for r in order:
        if roles[r][0]:
            store.client = r
            observers[r].lead_group(0, starts[r])
    reporter = next(r for r in order if roles[r][1])
    store.client = reporter
    outcome = observers[reporter].report(0, starts[reporter])
    for r in order:
        if r != reporter:
            store.client = r
            got = observers[r].await_verdict(0, starts[r])
            assert got is not None and [v.ranks for v in got.verdicts] == [(frozen,)]
    wall = time.perf_counter() - start
    leaders = [r for r in order if roles[r][0]]
    plain = [r for r in order if not roles[r][0] and not roles[r][1]]

    def per(ranks: list[int]) -> dict[str, float]:
        return {"messages_max": max(store.messages[r] for r in ranks),
                "bytes_max": max(store.bytes[r] for r in ranks)}

    heartbeat_s = max(1.0, world / HEARTBEAT_CAP_PER_S)
    return {
        "world": world, "peer_group_size": len(groups[0]), "groups": len(groups),
        "verdict": [(v.hang_class.value, list(v.ranks)) for v in outcome.verdicts],
        "observer": per(plain), "group_leader": per(leaders), "reporter": per([reporter]),
        "store_messages": sum(store.messages.values()), "store_bytes": sum(store.bytes.values()),
        "healthy_heartbeat_s": heartbeat_s, "healthy_store_messages_per_s": round(world / heartbeat_s),
        "simulation_wall_s": round(wall, 2),
    }


def scale_table(worlds: tuple[int, ...] = (1_000, 10_000, 100_000)) -> list[dict[str, Any]]:
    return [simulate(w) for w in worlds]


if __name__ == "__main__":
    print(json.dumps(scale_table(), indent=2))
