"""Folders SCOUT keeps state in are the job's own (issue 32, item 2): made 0700, links and other users' folders
refused by name, through the product's own users of them (the in-memory slots, the control folder)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from scout_core.checkpoint.memory import MemorySlots
from scout_core.control import ControlError, RunControl
from scout_core.private_dir import UnsafeFolderError, private_dir, shared_dir

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user needs root (CI is root)")


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_made_owner_only_at_every_missing_level(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c"
    private_dir(str(target), "checkpoint.memory_dir")
    assert [_mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", target)] == [0o700] * 3


def test_modes_ours_closed_shared_kept_and_open_to_all_refused(tmp_path: Path) -> None:
    """Our own folder others can enter is closed (a slot folder of an older release); one every user can write
    is refused, private or shared; a group's metrics folder keeps its group; a sticky folder (/tmp) is left be."""
    (tmp_path / "older").mkdir()
    os.chmod(tmp_path / "older", 0o755)
    private_dir(str(tmp_path / "older"), "x")
    assert _mode(tmp_path / "older") == 0o700
    for fn in (private_dir, shared_dir):
        (tmp_path / "open").mkdir(exist_ok=True)
        os.chmod(tmp_path / "open", 0o777)
        with pytest.raises(UnsafeFolderError, match="written by every user"):
            fn(str(tmp_path / "open"), "x")
    (tmp_path / "metrics").mkdir()
    os.chmod(tmp_path / "metrics", 0o2775)
    shared_dir(str(tmp_path / "metrics"), "report.prometheus.textfile_dir")
    assert _mode(tmp_path / "metrics") == 0o2775
    os.chmod(tmp_path / "open", 0o1777)
    private_dir(str(tmp_path / "open"), "control.directory")
    assert _mode(tmp_path / "open") == 0o1777


@as_root
def test_every_level_above_is_checked_not_only_the_nearest(tmp_path: Path) -> None:
    """A level anyone can write, however high, is refused; a project folder of another user that only its owner
    writes (a shared filesystem's) is accepted above the folder's own parent."""
    top = _planted(tmp_path, "theirs")
    os.chmod(top, 0o777)
    (top / "mine").mkdir()
    with pytest.raises(UnsafeFolderError, match="theirs can be written by every user"):
        private_dir(str(top / "mine" / "slots"), "checkpoint.memory_dir")
    os.chmod(top, 0o755)
    private_dir(str(top / "mine" / "slots"), "checkpoint.memory_dir")


def test_a_symbolic_link_in_its_place_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "slots").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeFolderError, match="symbolic link"):
        private_dir(str(tmp_path / "slots"), "checkpoint.memory_dir")


def test_a_parent_anyone_can_write_without_a_sticky_bit_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    os.chown(parent, NOBODY, NOBODY) if os.geteuid() == 0 else None
    if os.geteuid() == 0:
        with pytest.raises(UnsafeFolderError, match="no sticky bit|belongs to"):
            private_dir(str(parent / "slots"), "checkpoint.memory_dir")
    os.chmod(parent, 0o1777)  # like /dev/shm and /tmp: each user's folders stay each user's
    if os.geteuid() == 0:
        os.chown(parent, 0, 0)
    private_dir(str(parent / "slots"), "checkpoint.memory_dir")


def _planted(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir(mode=0o755)
    os.chown(folder, NOBODY, NOBODY)
    return folder


@as_root
def test_slots_refuse_a_folder_another_user_planted(tmp_path: Path) -> None:
    root = _planted(tmp_path, "scout-0123456789ab")
    with pytest.raises(UnsafeFolderError, match=r"scout-0123456789ab belongs to .*uid 65534.*checkpoint.memory_dir|"
                                                r"checkpoint.memory_dir: .*scout-0123456789ab belongs to"):
        MemorySlots(str(root), rank=0, hosts={0: "h0"}, fallback=str(tmp_path / "disk"))
    host = tmp_path / "mine"
    host.mkdir(mode=0o700)
    _planted(host, "h0")  # the machine's folder inside an otherwise good root
    with pytest.raises(UnsafeFolderError, match="h0 belongs to"):
        MemorySlots(str(host), rank=0, hosts={0: "h0"}, fallback=str(tmp_path / "disk"))


@as_root
def test_the_control_folder_refuses_another_users_run_folder_before_deleting_anything(tmp_path: Path) -> None:
    planted = _planted(tmp_path, "run-1")
    (planted / "keep").write_text("theirs")
    cfg = SimpleNamespace(control=SimpleNamespace(every_steps=1, directory=str(tmp_path)))
    with pytest.raises(ControlError, match="belongs to"):
        RunControl(cfg, run_id="run-1", rank=0, world_control=None)
    assert (planted / "keep").read_text() == "theirs"  # refused before the fresh start removed anything


def _enable_with_one_bad_machine(ctx):
    import time

    import scout_core
    from integrations_tests.models import start_rank
    from scout_core.config import load

    ctx.args.update(faults=[], seed=0, layout="ddp")
    _, _, par, opt = start_rank(ctx, timeout_s=60)
    d = ctx.args["dir"]
    memory = f"{d}/open/slots" if ctx.rank == 1 else f"{d}/shm"  # rank 1's machine: under a folder anyone writes
    cfg = load(None, ["checkpoint.enabled=true", f"checkpoint.directory={d}/ckpt", f"checkpoint.memory_dir={memory}",
                      f"report.jsonl_path={d}/inc.jsonl", "report.log_level=ERROR", "observer.enabled=false"])
    start = time.monotonic()
    try:
        scout_core.enable(par.model, opt, config=cfg).close(discard_snapshots=True)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return {"error": f"{type(exc).__name__}: {exc}", "s": time.monotonic() - start}
    return {"error": "", "s": time.monotonic() - start}


def test_a_folder_refused_on_one_machine_fails_enable_on_every_rank_at_once(tmp_path: Path) -> None:
    """Folders are checked where they are (each machine its own slot folder): the refusal on one rank reaches
    every rank in the same start-up step, instead of leaving the others in their next collective until the
    launcher's timeout."""
    from scout_core.testing.launcher import launch

    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)  # writable by all, no sticky bit
    result = launch(_enable_with_one_bad_machine, 3, timeout_s=90, args={"dir": str(tmp_path)})
    assert result.ok, result.failures()
    values = result.values()
    assert values[1]["error"].startswith("UnsafeFolderError"), values[1]
    for r in (0, 2):
        assert values[r]["error"].startswith("RuntimeError: SCOUT could not set up the checkpoint folders on rank 1")
        assert values[r]["s"] < 30, values[r]
