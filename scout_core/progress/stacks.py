"""A named rank's Python stack at the time of a hang verdict, for the record.

The verdict says where a rank is from what its trainer last published (the step, the collective it waits in, the
data loader); a rank stuck in Python code of the user's own is better shown by its stack. At ``enable()`` the trainer
arms :mod:`faulthandler` on a real-time signal nobody else uses (only where that signal has no handler yet), writing
every thread's stack into an anonymous in-memory file (``memfd``). When a verdict names the rank, its observer empties
that file, sends the signal, reads the dump through ``/proc/<trainer>/fd`` and writes it beside the incident file
(``<incidents>.stacks/<run>-episode-<n>-rank-<r>.txt``); the incident names that file. faulthandler writes from its
C signal handler, so this works while the training thread sits in a C call; a frozen trainer (SIGSTOP) cannot
answer, and the file says so.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time

__all__ = ["StacksArm", "arm_trainer_stacks", "capture_stacks", "main_thread_frames", "stacks_path"]

ANSWER_S = 2.0
"""How long an observer waits for its trainer's dump."""


def _signal() -> int:
    return int(signal.SIGRTMIN) + 3  # glibc keeps the first real-time signals for itself; SIGRTMIN is past them


def _caught(sig: int) -> bool:
    """Whether this process has a handler for ``sig`` (Python's, faulthandler's or C code's), from the kernel's
    view (``SigCgt`` in /proc/self/status): ``signal.getsignal`` sees only Python's."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return True  # unknown: assume taken


class StacksArm:
    """The trainer's side: the descriptor faulthandler writes to, and the main thread's id (its stack is the one a
    verdict is about)."""

    def __init__(self, fd: int, sig: int) -> None:
        self.fd, self.sig = fd, sig
        self.main_thread = threading.get_ident()  # the thread that enables SCOUT is the one that trains

    def disarm(self) -> None:
        """faulthandler puts back the handler it found, SIG_IGN (see :func:`arm_trainer_stacks`): a request that
        crosses this close is ignored, never the signal's default action (which ends the process). The file stays
        open (one descriptor, closed at exec): an observer that outlives its close may still open
        ``/proc/<trainer>/fd/<fd>``, which must never be another file by then."""
        with contextlib.suppress(Exception):
            faulthandler.unregister(self.sig)


def arm_trainer_stacks() -> StacksArm | None:
    """Arm the dump in the trainer (main thread only: signal handlers are installed there); None where the signal
    already has a handler (the job's own), or the platform has no memfd."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(os, "memfd_create"):
        return None
    sig = _signal()
    try:
        if _caught(sig):  # the job's own handler (Python's or a library's in C): never taken over
            return None
        memfd = os.memfd_create("scout-stacks", os.MFD_CLOEXEC)
        try:  # an appending description: after the observer empties the file, the next dump starts at 0
            fd = os.open(f"/proc/self/fd/{memfd}", os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        finally:
            os.close(memfd)
        signal.signal(sig, signal.SIG_IGN)  # what faulthandler puts back when it lets go: never the default
        faulthandler.register(sig, file=fd, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        return None
    return StacksArm(fd, sig)


def capture_stacks(pid: int, fd: int, sig: int, *, answer_s: float = ANSWER_S) -> str:
    """The dump of every thread of trainer ``pid`` (read by its observer), or a line saying why there is none."""
    try:
        rfd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"(no stack: the trainer's dump file is not readable: {exc})"
    try:
        os.ftruncate(rfd, 0)
        os.kill(pid, sig)
        deadline, size, since = time.monotonic() + answer_s, 0, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = os.fstat(rfd).st_size
            if now != size:
                size, since = now, time.monotonic()
            elif size and time.monotonic() - since >= 0.1:  # written whole: nothing added for 100 ms
                return os.pread(rfd, size, 0).decode(errors="replace")
        if size:
            return os.pread(rfd, size, 0).decode(errors="replace")
        return f"(no stack: the trainer did not answer within {answer_s:.0f} s: stopped, or its signals are blocked)"
    except OSError as exc:
        return f"(no stack: {exc})"
    finally:
        os.close(rfd)


def main_thread_frames(dump: str, main_thread: int, count: int = 3) -> list[str]:
    """The innermost ``count`` frames of the main thread in a faulthandler dump (most recent first)."""
    blocks = [b for b in dump.split("\n\n") if b.strip()]
    wanted = f"0x{main_thread:016x}"
    for block in blocks:
        lines = block.strip().splitlines()
        if lines and wanted in lines[0]:
            return [line.strip() for line in lines[1:1 + count]]
    return []


def stacks_path(jsonl_path: str, run_id: str, launch: str, episode: int, rank: int) -> str:
    """One file per launch, episode and rank (a restarted job keeps its run id and counts episodes from 0 again)."""
    root, _ = os.path.splitext(jsonl_path)
    return os.path.join(f"{root}.stacks", f"{run_id}-{launch[:8] or 'launch'}-episode-{episode}-rank-{rank}.txt")
