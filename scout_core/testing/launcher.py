"""Fork-based launcher for N local ranks on gloo (tests, cells, demos).

Spawning 16 fresh interpreters costs ~40 s on a 2-core machine because each
imports torch. Forking from a parent that already imported torch and the
distributed stack costs a few seconds. The parent must not have started
threads that hold locks (intra-op pools): call :func:`prepare_parent` before
forking, which pins torch to one thread per worker.

Each worker runs in its own process group (``setpgid``) so that a timeout can
kill it together with anything it forked (observer processes later), results
and tracebacks come back over a pipe per worker, and every child is reaped.
Gloo uses TCP on loopback, so nothing is left in ``/dev/shm``.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any

__all__ = ["RankContext", "RankOutcome", "LaunchResult", "launch", "prepare_parent", "free_port", "free_port_block"]

_PREPARED = False


def prepare_parent() -> None:
    """Import the heavy modules once and pin threads, so forked ranks start warm."""
    global _PREPARED
    if _PREPARED:
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    try:  # FSDP2 pulls dynamo in lazily; paying it in the parent saves it per rank
        import torch._dynamo  # noqa: F401
    except Exception:  # pragma: no cover - optional speed-up only
        pass
    torch.set_num_threads(1)
    _PREPARED = True


def free_port() -> int:
    """A TCP port that was free a moment ago on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive loopback ports, all free, outside the kernel's ephemeral range.

    A test that serves on ``base + local rank`` needs ports nobody else is handed meanwhile: a block from
    ``free_port()`` lies in the ephemeral range, where the launcher's own store port or any client socket can take
    ``base + k`` before rank k binds it (CI once saw exactly that). Below the range where there is room, else
    above it.
    """
    low, high = _ephemeral_range()
    spans = [(lo, hi) for lo, hi in ((10000, low - count), (high + 1, 65536 - count)) if hi > lo]
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200 if spans else 0):
        base = rng.randrange(*spans[0])
        if all(_bindable(base + k) for k in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports outside the ephemeral range {low}-{high}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = fh.read().split()[:2]
            return int(low), int(high)
    except (OSError, ValueError):  # not Linux: the IANA dynamic range
        return 49152, 65535


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class RankContext:
    """What a worker function receives."""

    rank: int
    world_size: int
    master_port: int
    args: dict[str, Any] = field(default_factory=dict)
    store_fd: int | None = None
    """Rank 0 only: a socket the launcher already listens on at ``master_port``, for the job's store (see
    :func:`init_gloo`)."""


@dataclass
class RankOutcome:
    rank: int
    ok: bool
    value: Any = None
    error: str | None = None
    exitcode: int | None = None


@dataclass
class LaunchResult:
    outcomes: list[RankOutcome]
    timed_out: bool
    wall_s: float
    stopped: bool = False
    """True when ``stop_when`` fired and the remaining ranks were killed on purpose."""

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(o.ok for o in self.outcomes)

    def values(self) -> list[Any]:
        return [o.value for o in self.outcomes]

    def failures(self) -> str:
        lines = []
        if self.timed_out:
            lines.append(f"timed out after {self.wall_s:.1f}s")
        for o in self.outcomes:
            if not o.ok:
                lines.append(f"rank {o.rank} (exit {o.exitcode}): {o.error or 'no result'}")
        return "\n".join(lines)


def init_gloo(ctx: RankContext, timeout_s: float = 60.0) -> None:
    """Join the job's default gloo process group over loopback.

    Rank 0 serves the job's store on the socket the launcher bound and listened on before it forked any rank
    (``ctx.store_fd``), as torchrun's agent does: a rank that connects before rank 0 serves waits in the socket's
    backlog. When rank 0 bound the port itself, the ranks that came first were refused or reset and retried, and
    a third of 16-rank launches here took 5.3 s instead of 0.3 s. The price: a rank waiting in the backlog for a
    rank 0 that never serves waits past ``timeout_s``, until the launch's own timeout kills it.
    """
    import torch.distributed as dist

    global _STORE_FD_USED
    timeout = timedelta(seconds=timeout_s)
    listen_fd = ctx.store_fd if ctx.rank == 0 and not _STORE_FD_USED else None
    if listen_fd is not None:
        _STORE_FD_USED = True  # the store owns (and closes) it; a second init binds the port itself
    store = dist.TCPStore("127.0.0.1", ctx.master_port, ctx.world_size, ctx.rank == 0, timeout=timeout,
                          master_listen_fd=listen_fd)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout)


_STORE_FD_USED = False


def _worker(fn: Callable[[RankContext], Any], ctx: RankContext, conn: Connection) -> None:
    os.setpgid(0, 0)
    code = 0
    try:
        value = fn(ctx)
        payload = pickle.dumps((True, value, None))
    except SystemExit as exc:  # a worker that exits on purpose keeps its exit status, as a real process would
        payload = pickle.dumps((False, None, f"SystemExit({exc.code})"))
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # report everything else
        payload = pickle.dumps((False, None, traceback.format_exc()))
        code = 1
    try:
        conn.send_bytes(payload)
        conn.close()
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        # Skip atexit handlers and buffered state inherited from the parent.
        os._exit(code)


def _kill_group(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


heartbeat: Callable[[], None] | None = None
"""Called every ``HEARTBEAT_S`` seconds while :func:`launch` waits for its ranks (a long cell says it is still
running), on the launching thread itself: a thread of its own in the parent could hold a lock at a fork."""
HEARTBEAT_S = 30.0


def launch(
    fn: Callable[[RankContext], Any],
    world_size: int,
    *,
    timeout_s: float = 120.0,
    args: dict[str, Any] | None = None,
    failure_grace_s: float = 5.0,
    stop_when: Callable[[], bool] | None = None,
    poll_s: float = 0.1,
    keep_groups: bool = False,
) -> LaunchResult:
    """Run ``fn(ctx)`` on ``world_size`` forked ranks and collect their results.

    ``fn`` must be a module-level function; it usually starts with
    :func:`init_gloo`. On timeout every worker's process group is killed.
    ``stop_when`` is polled every ``poll_s`` seconds; once it returns True the
    ranks still running are killed (hang cells end this way: their trainers
    never return by design). With ``keep_groups``, what a rank that exited
    leaves running in its process group (its observer answering for it) keeps
    running until ``stop_when`` is satisfied or the timeout.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    prepare_parent()
    listener = socket.create_server(("127.0.0.1", 0), backlog=max(world_size, 128))
    port = listener.getsockname()[1]
    start = time.monotonic()
    deadline = start + timeout_s
    pids: dict[int, int] = {}
    readers: dict[Connection, int] = {}
    outcomes = [RankOutcome(rank=r, ok=False) for r in range(world_size)]
    timed_out = False
    stopped = False
    try:
        for rank in range(world_size):
            ctx = RankContext(rank=rank, world_size=world_size, master_port=port, args=dict(args or {}),
                              store_fd=listener.fileno() if rank == 0 else None)
            _fork_rank(fn, ctx, pids, readers, listener)
        listener.close()  # rank 0 holds its own copy
        next_beat = time.monotonic() + HEARTBEAT_S
        while readers or (keep_groups and stop_when is not None):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if stop_when is not None and stop_when():
                stopped = True
                break
            wait_s = remaining if stop_when is None else min(remaining, poll_s)
            if heartbeat is not None:  # on this thread: the ranks are forked from it, so no other thread runs
                now = time.monotonic()
                if now >= next_beat:
                    try:
                        heartbeat()
                    except Exception:  # noqa: BLE001 - a progress line never fails the ranks it reports on
                        pass
                    next_beat = now + HEARTBEAT_S
                wait_s = max(min(wait_s, next_beat - now), 0.0)
            if not readers:
                time.sleep(wait_s)
                continue
            for conn in wait(list(readers), timeout=wait_s):
                rank = readers.pop(conn)
                outcomes[rank] = _receive(conn, rank)
                if not outcomes[rank].ok:
                    # Peers of a failed rank usually block in a collective: give
                    # them a short grace period to report, not the whole timeout.
                    deadline = min(deadline, time.monotonic() + failure_grace_s)
    finally:
        listener.close()
        _settle(pids, readers, outcomes, timed_out=timed_out, stopped=stopped)
    return LaunchResult(outcomes, timed_out, time.monotonic() - start, stopped)


def _fork_rank(fn: Callable[[RankContext], Any], ctx: RankContext, pids: dict[int, int],
               readers: dict[Connection, int], listener: socket.socket) -> None:
    """Fork rank ``ctx.rank`` to run ``fn(ctx)``; record its pid and the read end of its result pipe."""
    reader, writer = Pipe(duplex=False)
    pid = os.fork()
    if pid == 0:  # child: never returns
        reader.close()
        for other in readers:
            other.close()
        global _STORE_FD_USED
        _STORE_FD_USED = False  # a launch from inside a rank hands its rank 0 a fresh socket
        if ctx.store_fd is None:  # only rank 0 serves the store: with rank 0 gone, clients are refused, not queued
            listener.close()
        else:
            listener.detach()  # the store takes the descriptor over; this object must never close it
        _worker(fn, ctx, writer)
    writer.close()
    pids[ctx.rank] = pid
    readers[reader] = ctx.rank
    try:
        os.setpgid(pid, pid)  # also done in the child; whichever runs first wins
    except (ProcessLookupError, PermissionError):
        pass


def _receive(conn: Connection, rank: int) -> RankOutcome:
    """What a rank sent back over its result pipe, which is closed then."""
    try:
        ok, value, error = pickle.loads(conn.recv_bytes())
        outcome = RankOutcome(rank, ok, value, error)
    except EOFError:
        outcome = RankOutcome(rank, False, error="worker exited without a result")
    conn.close()
    return outcome


def _settle(pids: dict[int, int], readers: dict[Connection, int], outcomes: list[RankOutcome], *,
            timed_out: bool, stopped: bool) -> None:
    """Say why the ranks that never reported did not, kill them, and reap every rank."""
    for conn, rank in readers.items():
        why = ("killed at timeout" if timed_out else "stopped: the cell had what it waited for" if stopped
               else "killed after a peer failed")
        outcomes[rank].error = outcomes[rank].error or why
        conn.close()
    # Ranks that never reported are killed; the others are exiting on their own and are reaped
    # (killed only if they do not finish within _reap's grace), so their exit status is real.
    for rank in readers.values():
        _kill_group(pids[rank])
    for rank, pid in pids.items():
        _reap(pid, outcomes[rank])


def _reap(pid: int, outcome: RankOutcome) -> None:
    deadline = time.monotonic() + 10.0
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            outcome.exitcode = os.waitstatus_to_exitcode(status)
            if outcome.ok and outcome.exitcode != 0:
                outcome.ok = False
                outcome.error = f"exited with {outcome.exitcode} after reporting"
            break
        if time.monotonic() > deadline:
            _kill_group(pid)
            deadline = time.monotonic() + 10.0
        time.sleep(0.005)
    # Anything the worker forked shares its process group; take it down too.
    _kill_group(pid)
