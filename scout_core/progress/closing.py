"""How an observer ends with its trainer: the trainer's close, a stop on a verdict, a trainer that died.

Mixed into the observer (:class:`TrainerEnding`). A closing trainer publishes
CLOSED and then sends SIGTERM; while the observer is inside an episode or the
delivery of its records (its critical section) that SIGTERM waits, and the
trainer's ``close()`` waits for it, so the observer can still answer its peers.
After a stop on a verdict the observer sees its trainer out (SIGKILL once
:data:`STOP_GRACE_S` has passed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from scout_core.progress.classify import Evidence
from scout_core.progress.control import CLOSED_KEY, connect, daemon_key
from scout_core.progress.episode import CLOSED_LIST, EpisodeProtocol
from scout_core.progress.record import Phase, ProgressRecord, pid_alive
from scout_core.progress.sealed import seal_entry
from scout_core.progress.spec import ObserverSpec

__all__ = ["STOP_GRACE_S", "TrainerEnding"]

_CLOSING_STORE_TIMEOUT_S = 2.0
STOP_GRACE_S = 20.0
"""After a hang verdict with ``actions.on_verdict: stop``, how long a trainer has to end on SIGTERM before its
observer kills it. A Python SIGTERM handler runs only when the main thread gets back to the interpreter, which a
trainer blocked inside a collective never does; a framework's handler may only set a flag it reads between
iterations (Megatron's ``--exit-signal-handler``)."""


class _Closing(BaseException):
    """The trainer closed SCOUT (published CLOSED, then SIGTERM). A BaseException: it is raised from a signal
    handler anywhere, and no ``except Exception`` on the way (a user callback's guard) may swallow it."""


class TrainerEnding:
    """The observer's end of life with its trainer: SIGTERM, the critical section, the closing messages."""

    # Provided by the observer this is mixed into.
    spec: ObserverSpec
    record: ProgressRecord | None
    store: Any
    proto: EpisodeProtocol | None
    _critical: bool
    _close_pending: bool
    _protocol: Callable[[Any], EpisodeProtocol]
    _evidence: Callable[..., Evidence]
    _namespace: Callable[[], str]

    @contextlib.contextmanager
    def _critical_section(self, *, closing: bool = False) -> Iterator[None]:
        """An episode or the delivery of its records: a closing trainer's SIGTERM waits until it ends, and the
        trainer's close() sees (one byte of the record) that it must wait for us rather than kill us.
        ``closing``: our closing messages; the byte stays set until we exit."""
        self._critical = True
        if self.record is not None:
            self.record.set_observer_busy(True)
        try:
            yield
        finally:
            self._critical = False
            if self.record is not None and not closing:
                self.record.set_observer_busy(False)
            pending, self._close_pending = self._close_pending, False  # moot if we leave by an exception
        if pending:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # closing now: a second SIGTERM changes nothing
            raise _Closing

    def _on_sigterm(self, *_: Any) -> None:
        # The trainer's close() publishes CLOSED, then terminates us: we still answer an open episode (a
        # trainer that closes after its collective failed is gone for its waiting peers, not lost). The
        # parent-death signal is SIGTERM too: a trainer that died without closing gets one last episode
        # (the loop answers for it), so that signal must not end us; any other SIGTERM (a launcher tearing
        # the job down) does.
        closed = self.record is not None and self.record.read().phase is Phase.CLOSED
        if closed:
            if self._critical:
                self._close_pending = True  # finish the episode and the callbacks first (close() waits)
                return
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # closing now: a second SIGTERM changes nothing
            raise _Closing
        if self._trainer_gone():
            return
        sys.exit(0)

    def _answer_closed(self) -> None:
        """Our trainer closed: mark it closed (a leader counts a closed member as gone, not lost), answer an
        open episode that it is gone, and count it out with a store daemon (which exits once every rank
        has). Over our own connection (the trainer's close() waits for us, briefly); a fresh one only if
        that fails (the signal may have interrupted it mid-message). Never raises."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt these messages
        with self._critical_section(closing=True):  # close() waits for these too
            for attempt in range(2):
                try:
                    self._closed_messages(self.store if attempt == 0 else
                                          connect(self.spec.control, self._namespace(), _CLOSING_STORE_TIMEOUT_S))
                    return
                except Exception:  # noqa: BLE001 - best effort; the store may be gone with the job
                    continue

    def _closed_messages(self, store: Any) -> None:
        spec = self.spec
        if store is None:
            raise RuntimeError("no store")
        # Short waits: an unreachable store must not hold the trainer's close() (it waits while we are busy).
        store.set_timeout(timedelta(seconds=_CLOSING_STORE_TIMEOUT_S))
        # Sealed entries, read as sets of ranks: a retry after a first attempt was cut off appends the same rank
        # again and counts once (no unsealed counter an outsider could set to keep this rank off the list).
        store.append(CLOSED_LIST, seal_entry(spec.control.secret, CLOSED_LIST, str(spec.rank)))
        if spec.control.needs_beats:
            key = daemon_key(CLOSED_KEY)
            store.underlying_store.append(key, seal_entry(spec.control.secret, key, str(spec.rank)))
        if self.record is None or not store.check([f"ep/{self.proto.episode if self.proto else 0}/open"]):
            return
        proto = self._protocol(store)
        proto.episode = self.proto.episode if self.proto else proto.episode
        snap = self.record.read()
        proto.post(self._evidence(snap, time.monotonic() - snap.t_publish, silent=True, alive=False))

    def _trainer_gone(self) -> bool:
        """The trainer (our parent: it forked us) has exited or is exiting.

        Linux reparents us before it delivers the parent-death signal, while the trainer may not be a zombie
        yet: asking only whether its pid is alive raced with that signal and left its record behind."""
        return os.getppid() != self.spec.trainer_pid or not pid_alive(self.spec.trainer_pid)

    def _trainer_closing(self) -> bool:
        return self.record is not None and self.record.read().phase is Phase.CLOSED

    def _see_trainer_out(self) -> None:
        """After the stop's SIGTERM: wait for the trainer to end, and SIGKILL it if it is still there after
        :data:`STOP_GRACE_S`. A trainer closing SCOUT (a handler that exits, or a close already under way) is
        answered as any close is (its close waits for that answer), never killed. Whatever interrupts the wait (a
        launcher's SIGTERM) still ends a trainer that is left."""
        start = time.monotonic()
        try:
            while not self._trainer_gone():
                if self._trainer_closing():
                    self._answer_closed()
                    return
                if time.monotonic() - start > STOP_GRACE_S:
                    self._kill_trainer()
                    return
                time.sleep(0.1)
        except _Closing:
            self._answer_closed()
        except BaseException:
            if not self._trainer_gone():
                self._kill_trainer()
            raise

    def _kill_trainer(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.spec.trainer_pid, signal.SIGKILL)
        gone_by = time.monotonic() + 2.0  # a large process takes a moment to die: then its record can go
        while not self._trainer_gone() and time.monotonic() < gone_by:
            time.sleep(0.05)
