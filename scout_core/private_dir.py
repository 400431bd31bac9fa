"""Folders SCOUT keeps its state in are the job's own: made owner-only, and refused when someone else made them.

In-memory snapshot slots live under ``/dev/shm`` (or ``/tmp``), which every user of a machine can write, at a
path another user can predict. If SCOUT used a folder it found there, another user could plant a slot that the
next restart restores, or link a name to a file SCOUT would then overwrite. So every such folder is

* created ``0700`` (each missing level of it);
* opened with ``O_NOFOLLOW``, so a symbolic link planted in its place is refused;
* checked for its owner: it must be the user the job runs as;
* narrowed back to ``0700`` if it is ours, open to others, and not a shared sticky folder;

and every folder above it must be the user's or root's, and writable by every user only with the sticky bit
(``/dev/shm`` and ``/tmp`` have it), so nobody else can swap a level between the check and its use.

A folder that fails is refused with :class:`UnsafeFolderError`, which names it and says what to do.
"""

from __future__ import annotations

import os
import pwd
import stat

__all__ = ["UnsafeFolderError", "check_parent", "private_dir", "shared_dir"]


class UnsafeFolderError(PermissionError):
    """A folder SCOUT would keep state in belongs to someone else, or could be changed by someone else."""


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_parent(parent: str, what: str) -> None:
    """``parent`` must be this user's or root's, and no folder from it up to ``/`` may be writable by every user
    without the sticky bit: otherwise anyone could rename a level and put their own in its place between SCOUT's
    check and its use. Higher levels may belong to others (a project folder on a shared filesystem): their
    owners are trusted as the job's. A folder writable by its group is accepted: the group is the job's
    operators."""
    me = os.geteuid()
    level = os.path.abspath(parent)
    while True:
        try:
            st = os.stat(level)
        except FileNotFoundError:
            st = None  # made below, level by level, by private_dir itself
        if st is not None:
            if not stat.S_ISDIR(st.st_mode):
                raise UnsafeFolderError(f"{what}: {level} is not a folder")
            if st.st_uid not in (me, 0) and level == os.path.abspath(parent):
                owners = _user(me) + (" or root" if me else "")
                raise UnsafeFolderError(f"{what}: {level} belongs to {_user(st.st_uid)}, not to {owners}; choose "
                                        f"a folder of your own")
            if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
                raise UnsafeFolderError(f"{what}: {level} can be written by every user and has no sticky bit, "
                                        f"so another user could replace what SCOUT keeps below it; choose a "
                                        f"folder of your own")
        up = os.path.dirname(level)
        if up == level:
            return
        level = up


def _open_checked(path: str, what: str, mode: int, *, made: bool, allow_root: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if os.path.islink(path):
            raise UnsafeFolderError(f"{what}: {path} is a symbolic link; SCOUT does not follow links for its "
                                    f"state; remove it") from None
        raise UnsafeFolderError(f"{what}: {path} cannot be opened as a folder ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if not (st.st_uid == me or allow_root and st.st_uid == 0):
            raise UnsafeFolderError(f"{what}: {path} belongs to {_user(st.st_uid)}, not to {_user(me)} that runs "
                                    f"this job; remove it, or point SCOUT at another folder")
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if st.st_mode & stat.S_IWOTH and not sticky:
            raise UnsafeFolderError(f"{what}: {path} can be written by every user; remove that permission "
                                    f"(chmod o-w) or point SCOUT at another folder")
        if made:
            os.fchmod(fd, mode)  # exactly what was asked for, whatever the umask left
        elif mode == 0o700 and not sticky and st.st_uid == me and stat.S_IMODE(st.st_mode) & 0o077:
            # SCOUT's own private folder from an earlier run (or release) that others can enter: close it.
            # A shared sticky folder (/tmp) given as the folder itself is never changed.
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o077)
    finally:
        os.close(fd)


def _make(path: str, what: str, mode: int, allow_root: bool = False) -> str:
    path = os.path.abspath(path)
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    check_parent(probe if missing else os.path.dirname(path), what)
    for level in reversed(missing):
        try:
            os.mkdir(level, mode)
            made = True
        except FileExistsError:
            made = False  # made by another rank of this machine meanwhile: checked like any other
        _open_checked(level, what, mode, made=made)
    if not missing:
        _open_checked(path, what, mode, made=False, allow_root=allow_root)
    return path


def private_dir(path: str, what: str) -> str:
    """``path`` as a folder only this user can enter (``0700``), made if missing; its absolute path.
    ``what`` names the setting it comes from, for the error."""
    return _make(path, what, 0o700)


def shared_dir(path: str, what: str) -> str:
    """Like :func:`private_dir`, for a folder another local reader must list (a node exporter's textfile folder):
    ``0755`` when made here; an existing one may be root's and its group's (never writable by every user) and
    is not changed."""
    return _make(path, what, 0o755, allow_root=True)
