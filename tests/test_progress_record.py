"""The shared-memory progress record: layout, torn-read safety, permissions, cleanup."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from scout_core.progress.record import Phase, ProgressRecord, create_record, pid_alive, reclaim_stale


@pytest.fixture
def shm(tmp_path):
    return str(tmp_path)


def test_publish_and_read_round_trip(shm):
    rec = create_record("run1", 4, directory=shm)
    rec.publish(7, 120, Phase.BACKWARD)
    reader = ProgressRecord(rec.path, owner=False)
    snap = reader.read()
    assert (snap.step, snap.op_id, snap.phase, snap.pending) == (7, 120, Phase.BACKWARD, False)
    assert snap.owner_pid == os.getpid()
    rec.publish(7, 121, Phase.COLLECTIVE, True, 123,
                (0xABCDEF, "all_reduce|group=16@0,1|shapes=10|dtypes=float32|op=SUM"))
    snap = reader.read()
    assert snap.pending and snap.phase is Phase.COLLECTIVE and snap.fp_hash == 0xABCDEF
    assert (snap.op_id, snap.launched) == (121, 123)
    assert snap.fingerprint.startswith("all_reduce|group=16")
    rec.publish(7, 122, Phase.FORWARD)
    snap = reader.read()
    assert not snap.pending and snap.fp_hash == 0xABCDEF  # the last collective stays visible


def test_gaps_between_publishes_are_learned_only_once_learning(shm):
    rec = create_record("gaps", 0, directory=shm)
    time.sleep(0.05)
    rec.publish(0, 0, Phase.FORWARD)  # warm-up: not learned
    reader = ProgressRecord(rec.path, owner=False)
    assert reader.read().gap_max == 0.0
    rec.learning = True
    time.sleep(0.02)
    rec.publish(1, 0, Phase.FORWARD)
    assert reader.read().gap_max == 0.0  # learned, not yet published: the step is not complete
    rec.commit_gaps()
    rec.publish(1, 0, Phase.FORWARD)
    assert 0.02 <= reader.read().gap_max < 0.05
    rec.publish(2, 0, Phase.CHECKPOINT_WRITE)
    time.sleep(0.06)
    rec.publish(2, 0, Phase.COMPUTE)  # a gap spent in checkpoint I/O is not the training rhythm
    rec.learn_below = lambda published: 0.05  # nor is a gap past the threshold in force (a stall)
    rec.publish(2, 0, Phase.FORWARD)
    time.sleep(0.06)
    rec.publish(2, 0, Phase.FORWARD)
    rec.commit_gaps()
    rec.publish(3, 0, Phase.FORWARD)
    assert reader.read().gap_max < 0.05


def test_phase_start_time_only_moves_on_phase_change(shm):
    rec = create_record("run1", 0, directory=shm)
    rec.publish(1, 1, Phase.FORWARD)
    t0 = ProgressRecord(rec.path, owner=False).read().t_phase
    time.sleep(0.01)
    rec.publish(1, 2, Phase.FORWARD)
    snap = ProgressRecord(rec.path, owner=False).read()
    assert snap.t_phase == t0 and snap.t_publish > t0


def test_owner_only_permissions_and_exclusive_create(shm):
    rec = create_record("perm", 1, directory=shm)
    mode = stat.S_IMODE(os.stat(rec.path).st_mode)
    assert mode == 0o600
    with pytest.raises(FileExistsError):
        create_record("perm", 1, directory=shm)


def test_bad_run_id_rejected(shm):
    with pytest.raises(ValueError):
        create_record("../etc", 0, directory=shm)


def test_no_torn_reads_under_a_concurrent_writer(shm):
    rec = create_record("torn", 0, directory=shm)
    pid = os.fork()
    if pid == 0:
        try:
            end = time.monotonic() + 1.0
            i = 0
            while time.monotonic() < end:
                i += 1
                # Every field encodes i, so a torn read shows up as a mix of values.
                if i % 3:
                    rec.publish(i, i, Phase(i % 9))
                else:
                    rec.publish(i, i, Phase.COLLECTIVE, True, i, (i, f"op-{i}" * (1 + i % 7)))
        finally:
            os._exit(0)
    reader = ProgressRecord(rec.path, owner=False)
    reads = 0
    deadline = time.monotonic() + 0.9
    while time.monotonic() < deadline:
        snap = reader.read()
        assert snap.step == snap.op_id
        if snap.pending:
            assert snap.fp_hash == snap.step
            assert snap.fingerprint == f"op-{snap.step}" * (1 + snap.step % 7)
        reads += 1
    os.waitpid(pid, 0)
    assert reads > 1000


def test_a_field_stale_under_a_fresh_sequence_is_never_read(shm):
    """What a weakly ordered machine (Arm) can show a reader: the new even sequence already visible while
    one field still holds its old bytes. The sequence lock alone accepts it; the CRC must not."""
    import struct

    rec = create_record("weak", 0, directory=shm)
    rec.publish(7, 70, Phase.FORWARD)
    old_step = bytes(rec._mm[8:16])
    rec.publish(8, 80, Phase.BACKWARD)
    reader = ProgressRecord(rec.path, owner=False)
    assert reader.read().coordinate[:2] == (8, 80)
    rec._mm[8:16] = old_step  # the step field of the previous publish, under the current even sequence
    assert struct.unpack_from("<Q", rec._mm, 0)[0] % 2 == 0
    with pytest.raises(RuntimeError, match="kept changing"):
        reader.read(timeout_s=0.05)  # retries until the write is whole, never returns step 7 with op 80
    rec._mm[8:16] = struct.pack("<q", 8)  # the store becomes visible
    assert reader.read().coordinate[:2] == (8, 80)


def test_stale_segments_of_dead_owners_are_reclaimed(shm):
    pid = os.fork()
    if pid == 0:
        create_record("stale", 2, directory=shm)
        os._exit(0)  # exits without running atexit: the segment stays behind
    os.waitpid(pid, 0)
    assert not pid_alive(pid)
    leftovers = [f for f in os.listdir(shm) if f.startswith("scout-progress-stale")]
    assert len(leftovers) == 1
    live = create_record("live", 0, directory=shm)
    removed = reclaim_stale(shm)
    assert removed == []  # create_record already reclaimed it
    assert [f for f in os.listdir(shm) if f.startswith("scout-progress-stale")] == []
    assert os.path.exists(live.path)


def test_segment_removed_at_normal_exit(shm):
    code = ("from scout_core.progress.record import create_record; "
            f"print(create_record('atexit', 0, directory={shm!r}).path)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = out.stdout.strip()
    assert path.startswith(shm) and not os.path.exists(path)


def test_the_observers_busy_byte_is_apart_from_the_trainers_fields(shm):
    """close() reads it to let an observer in an episode finish; writing it never tears the trainer's record."""
    rec = create_record("busy", 0, directory=shm)
    rec.publish(3, 7, Phase.COLLECTIVE, True, 7, (5, "all_reduce"))
    observer = ProgressRecord(rec.path, owner=False)
    assert not rec.observer_busy
    observer.set_observer_busy(True)
    assert rec.observer_busy
    snap = observer.read()  # the CRC still validates: the byte is outside what it covers
    assert (snap.step, snap.op_id, snap.fingerprint) == (3, 7, "all_reduce")
    observer.set_observer_busy(False)
    assert not rec.observer_busy


def test_the_trainers_live_settings_reach_the_observer_apart_from_its_fields(shm):
    """`scout ctl set actions.on_verdict=...` / `report.log_level=...` after the observer was forked."""
    rec = create_record("live", 0, directory=shm)
    rec.publish(3, 7, Phase.COLLECTIVE, True, 7, (5, "all_reduce"))
    observer = ProgressRecord(rec.path, owner=False)
    assert observer.live() == (None, None)  # as configured at enable()
    rec.set_live(on_verdict="stop")
    assert observer.live() == ("stop", None)
    rec.set_live(log_level=40)
    rec.set_live(on_verdict="log")
    assert observer.live() == ("log", 40)
    observer.set_observer_busy(True)
    assert observer.live() == ("log", 40) and observer.read().fingerprint == "all_reduce"
