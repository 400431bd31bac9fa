"""The observer as a fresh interpreter: how the trainer starts it, and its entry point.

``python -P -u -c ...`` (:func:`entry`), started by :func:`spawn_observer`, not an ``os.fork()`` of the trainer:
a trainer with CUDA, NCCL and InfiniBand memory registered is unsafe to fork on older kernels without
``RDMAV_FORK_SAFE``, and a forked child's copy-on-write pages grow the trainer's host memory for the whole run.
The observer needs no torch (its store client speaks the protocol itself: :mod:`~scout_core.progress.store_client`),
so it is ready in a fraction of a second.

Everything it is told travels as JSON in an anonymous in-memory file it inherits (:func:`spec_to_wire`; an
unlinked 0600 temporary file where memfd is missing), never in its command line, which ``ps`` shows to every
user: the control store's secret is in it. Written before the child starts, it cannot block the trainer (a
pipe's buffer holds 64 KiB; the spec of a 100k-rank job is MBs). The user's ``on_incident`` callback crosses as
an import path (``module:qualname``); a callback that has none (a lambda, a closure, a bound method, a function
of the training script itself or of a module loaded from a file) cannot, and the trainer forks
the observer instead (:func:`~scout_core.progress.observer.start_observer` says so once). The callback's module
is imported again in the observer: its import-time side effects run there too, and a module that imports torch
costs the observer torch's start-up (about 2 s and 200 MB), so keep it light.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from scout_core.progress.control import ControlPlane
from scout_core.progress.process import OBSERVER_STACKS_SIGNAL, _die_with_parent, _prctl
from scout_core.progress.spec import ObserverSpec

__all__ = ["callback_path", "resolve_callback", "spawn_observer", "spec_to_wire"]

_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
"""Every observer we started, kept referenced: a collected ``Popen`` would reap our observer itself (its
``__del__`` and ``subprocess._cleanup``), and the trainer's own ``waitpid`` would lose its exit status."""


_NAMED: dict[int, tuple[Any, str]] = {}
"""The callbacks users named by path (:func:`named_callback`), by id: the path a user gave stays the path the
observer imports (a callable instance or a ``partial`` named by a module attribute has no ``__qualname__``)."""


def callback_path(fn: Callable[..., Any] | str | None) -> str | None:
    """``module:qualname`` that imports back to ``fn`` in a fresh interpreter, else None. A string is taken as
    such a path (checked by :func:`resolve_callback`)."""
    if fn is None:
        return None
    if isinstance(fn, str):
        resolve_callback(fn)
        return fn
    named = _NAMED.get(id(fn))
    if named is not None and named[0] is fn:
        return named[1]
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module == "__main__" or "<" in qualname:
        return None
    path = f"{module}:{qualname}"
    try:
        if resolve_callback(path) is not fn:
            return None
    except (ImportError, AttributeError, ValueError):
        return None
    return path if _findable(module.split(".")[0]) else None


def _findable(top: str) -> bool:
    """Whether a fresh interpreter finds the top-level module ``top`` where this one did: some import finder
    (the path finder, an editable install's hook) finds it at the same origin. Found here through sys.modules
    only, a module loaded from a file path is not."""
    origin = getattr(getattr(sys.modules.get(top), "__spec__", None), "origin", None)
    for finder in sys.meta_path:
        try:
            spec = finder.find_spec(top, None)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001,S112 - a finder that cannot answer: ask the next
            continue
        if spec is not None:
            return spec.origin == origin or (spec.origin is None and origin is None)  # a namespace package
    return False


def named_callback(path: str) -> Callable[..., Any]:
    """The callable a user named by path (``enable(on_incident="module:function")``); the observer imports that
    same path."""
    target = resolve_callback(path)
    _NAMED[id(target)] = (target, path)
    return target


def resolve_callback(path: str) -> Callable[..., Any]:
    """The callable a ``module:qualname`` path names; ValueError when it names none."""
    module, sep, qualname = path.partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"on_incident must be a callable or 'module:function', got {path!r}")
    if module == "__main__":
        raise ValueError(f"on_incident {path!r}: the training script is not importable in the observer; move the "
                         "function into a module")
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"on_incident {path!r} names {type(target).__name__}, not a callable")
    return target


def spec_to_wire(spec: ObserverSpec, *, callback: str | None) -> dict[str, Any]:
    """What the spawned observer is told, as plain JSON (the spec's own callback is dropped: it crosses by path)."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "on_incident"}
    fields["control"] = spec.control.to_dict()
    fields["hosts"] = {str(r): h for r, h in spec.hosts.items()}
    fields["devices"] = {str(r): d for r, d in spec.devices.items()}
    return {"spec": fields, "callback": callback, "sys_path": [p for p in sys.path if isinstance(p, str)]}


def spec_from_wire(wire: dict[str, Any]) -> ObserverSpec:
    fields = dict(wire["spec"])
    fields["control"] = ControlPlane(**fields["control"])
    fields["hosts"] = {int(r): h for r, h in fields["hosts"].items()}
    fields["devices"] = {int(r): d for r, d in fields["devices"].items()}
    return ObserverSpec(**fields)


def _wire_file(wire: dict[str, Any]) -> int:
    """The wire in an unlinked in-memory file, at offset 0; where memfd is missing (glibc < 2.27), an unlinked
    temporary file, mode 0600, in the temporary directory."""
    data = json.dumps(wire).encode()
    try:
        fd = os.memfd_create("scout-observer-spec", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        with tempfile.TemporaryFile() as fallback:  # held open until dup'ed: its number is ours until then
            fd = os.dup(fallback.fileno())
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def spawn_observer(spec: ObserverSpec, *, callback: str | None) -> tuple[int, int]:
    """Start the observer as a fresh interpreter; return ``(pid, read end of its readiness pipe)``."""
    import scout_core

    # Where this scout_core lives, appended after the standard library (PYTHONPATH would put it ahead, where a
    # package installed beside it could shadow the standard library in the observer alone).
    root = os.path.dirname(os.path.dirname(os.path.abspath(scout_core.__file__)))
    boot = f"import sys; sys.path.append({root!r}); from scout_core.progress.spawn import entry; entry()"
    wire = spec_to_wire(spec, callback=callback)
    read_fd, write_fd = os.pipe()
    # Linux's parent-death signal follows the thread that started the child: only the main thread lives as long
    # as the process (see process.fork_observer); elsewhere the observer's liveness check ends it.
    wire["ready_fd"], wire["death_signal"] = write_fd, threading.current_thread() is threading.main_thread()
    try:
        spec_fd = _wire_file(wire)
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    # The stacks signal stays blocked (the mask survives exec) until the child has its handler: its default
    # action would end the child. -P: the working directory never shadows scout_core; -u: what a callback
    # prints is not lost in a buffer when the observer ends.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {OBSERVER_STACKS_SIGNAL})
    try:
        child = subprocess.Popen([sys.executable, "-P", "-u", "-c", boot, str(spec_fd)],
                                 stdin=subprocess.DEVNULL, pass_fds=(write_fd, spec_fd), close_fds=True)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.close(write_fd)
        os.close(spec_fd)
    previous = _CHILDREN.get(child.pid)
    if previous is not None and previous.returncode is None:
        previous.returncode = 0  # a reused pid: the old Popen, reaped by our own waitpid, must never poll the new one
    _CHILDREN[child.pid] = child
    return child.pid, read_fd


def _main() -> int:
    """The spawned observer: read what it is told, then run as a forked one would."""
    with contextlib.suppress(Exception):
        faulthandler.register(OBSERVER_STACKS_SIGNAL, file=2, all_threads=True)
    # Every signal unblocked: the mask survives exec, and one a trainer thread blocked (its SIGTERM) would
    # otherwise keep its close() from ending us.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    with os.fdopen(int(sys.argv[1]), "rb") as spec_file:
        wire = json.loads(spec_file.read())
    for path in reversed(wire["sys_path"]):  # the trainer's modules import here as they did there
        if path not in sys.path:
            sys.path.insert(0, path)
    from scout_core.progress.observer import _Observer

    spec = spec_from_wire(wire)
    _log_like_a_trainer(spec)
    prctl = _prctl() if wire["death_signal"] else None
    if prctl is not None:
        _die_with_parent(prctl)
    if os.getppid() != spec.trainer_pid:  # the trainer died before we asked to follow it
        return 0
    if wire["callback"]:
        try:
            spec.on_incident = resolve_callback(wire["callback"])
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - diagnosis goes on without the callback, and says so
            logging.getLogger("scout").error(
                "SCOUT: rank %d's observer cannot import on_incident %r (%s: %s); hang verdicts are still "
                "recorded, without the callback", spec.rank, wire["callback"], type(exc).__name__, exc)
    return _Observer(spec, wire["ready_fd"]).run(release_files=False)  # its parent-death signal is set above


def _log_like_a_trainer(spec: ObserverSpec) -> None:
    """A forked observer inherits its trainer's logging set-up; a fresh one has none, and the verdict's log line
    (at ``report.log_level``, INFO included) would be dropped: it gets a handler of its own, to stderr (the
    trainer's level, files and format are not known here)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [scout observer {spec.rank}] %(message)s"))
    scout_log = logging.getLogger("scout")
    scout_log.addHandler(handler)
    scout_log.setLevel(logging.DEBUG)  # each sink logs at its own level (report.log_level, changed live too)
    scout_log.propagate = False


def entry() -> None:
    """The spawned observer's process: :func:`_main`, and its exit code (never returns)."""
    code = 1
    try:
        code = _main()
    except SystemExit:
        code = 0  # SIGTERM from a trainer that closed: a normal end
    except BaseException:  # noqa: BLE001 - never die silently
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)
