"""A forked observer's process, cut loose from the trainer's files, signals and fate.

Forked with ``observer.start_method: fork`` or a callback without an import path (the default is a fresh
interpreter: :mod:`~scout_core.progress.spawn`), the observer starts in milliseconds with everything it needs
already imported, and from then on runs on its own interpreter and GIL: a trainer blocked in a collective, in a
kernel or in ``SIGSTOP`` cannot block it. Fork safety: the child touches none of the trainer's threads, locks, CUDA or
communicators. It only maps the progress record, opens its own client
socket to the control store and writes files; ``logging`` re-initialises its
locks at fork (CPython's at-fork hooks), and nothing else it uses holds a lock
another thread of the trainer could have held
(``integrations_tests/test_observer_fork.py`` forks while other threads hold them).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import threading
import traceback
from collections.abc import Callable

__all__ = ["OBSERVER_STACKS_SIGNAL", "fork_observer"]

_PR_SET_PDEATHSIG = 1
OBSERVER_STACKS_SIGNAL = signal.SIGUSR1
"""Makes an observer print every thread's Python stack to stderr (a trainer whose observer does not start)."""


def fork_observer(run: Callable[[int, Callable[..., int] | None], int]) -> tuple[int, int]:
    """Fork the observer process, which calls ``run(ready_fd, death_signal)`` and exits with the code it returns;
    return ``(pid, read end of its readiness pipe)``. ``death_signal`` is libc's ``prctl`` where the observer
    should ask for the parent-death signal (:func:`_die_with_parent`), else None."""
    read_fd, write_fd = os.pipe()
    # Linux's parent-death signal follows the forking THREAD, not the process: forked from a thread that
    # later exits (enable() called from a set-up thread), the observer would be killed while its trainer
    # lives on. Only the main thread lives as long as the process; elsewhere the loop's liveness check of
    # the trainer (at least once a second) is what ends the observer.
    death_signal = threading.current_thread() is threading.main_thread()
    # Looked up here, before the fork: the forked child of a threaded trainer does as little as it can (a symbol
    # lookup there is one thing less that could meet a lock another trainer thread held at the fork).
    prctl = _prctl() if death_signal else None
    # The stacks signal is blocked until the child has its handler: its default action would end the child.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {OBSERVER_STACKS_SIGNAL})
    try:
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:  # observer process: never returns
        os.close(read_fd)
        code = 0
        try:
            # A trainer kept waiting for us asks where we are; written to fd 2 itself (sys.stderr may be no file,
            # or a buffered writer whose lock another trainer thread held at the fork).
            with contextlib.suppress(Exception):
                faulthandler.register(OBSERVER_STACKS_SIGNAL, file=2, all_threads=True)
            # Every signal unblocked: one a trainer thread blocked (its SIGTERM) would keep close() from ending us.
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            code = run(write_fd, prctl)
        except SystemExit:
            code = 0  # SIGTERM from a trainer that closed: a normal end
        except BaseException:  # noqa: BLE001 - last resort: never let the observer die silently
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os.close(write_fd)
    return pid, read_fd


def _release_inherited_files(keep: set[int]) -> None:
    """Point every file descriptor inherited from the trainer, but ``keep``, at /dev/null.

    Its communicator sockets above all: held open here they would keep a dead trainer's connections alive
    (its gloo peers would wait instead of failing) and pin its files. Not closed: Python objects inherited
    from the trainer still hold those numbers, and one finalized later would close whatever file of ours
    had reused its number (the store's socket, the incident log)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: the low numbers, where a process's files are
        fds = list(range(3, 4096))
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        if fd in keep or fd == null:
            continue
        with contextlib.suppress(OSError):
            os.fstat(fd)
            os.dup2(null, fd)
    os.close(null)


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, looked up in the trainer before the observer is forked (see :func:`fork_observer`)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except Exception:  # noqa: BLE001 - no libc prctl: the loop's liveness check still ends the observer
        return None


def _die_with_parent(prctl: Callable[..., int]) -> None:
    """Ask Linux to SIGTERM us when the trainer exits (the loop also checks). ``prctl`` was looked up before the
    fork."""
    with contextlib.suppress(Exception):
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

