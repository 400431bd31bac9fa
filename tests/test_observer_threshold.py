"""The observer's silence threshold adapts to silences that its peers' evidence shows were healthy.

One observer runs its real watch loop in this process, over an in-memory store; a thread plays its trainer
(publishing into a real record) and another plays the one peer, which keeps working whenever asked.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import torch.distributed as dist

from scout_core.progress.classify import Evidence
from scout_core.progress.control import ControlPlane
from scout_core.progress.episode import EpisodeProtocol
from scout_core.progress.observer import ObserverSpec, _Observer, silence_threshold
from scout_core.progress.record import Phase, ProgressRecord, create_record

FP = (77, "all_reduce|group=2@0,1")


def test_threshold_is_the_longest_of_the_published_and_the_learned_gap():
    spec = ObserverSpec(run_id="t", rank=0, world_size=2, record_path="", control=ControlPlane("h", 1, "configured"),
                        peer_groups=[[0, 1]], hosts={}, devices={}, silence_threshold_s=1.0, gather_timeout_s=1.0,
                        startup_timeout_s=1.0, jsonl_path=None)

    class Snap:
        gap_max, phase, pending = 0.1, Phase.FORWARD, False

    assert silence_threshold(spec, Snap()) == 1.0
    assert silence_threshold(spec, Snap(), learned_gap=3.0) == 12.0  # 4 x the learned gap
    assert silence_threshold(spec, Snap(), learned_gap=1000.0) == 300.0  # capped at the warm-up tolerance


def _peer_keeps_working(store, stop: threading.Event) -> None:
    """Rank 1's observer: answers every episode that its trainer is at the same collective, not silent."""
    answered: set[int] = set()
    while not stop.is_set():
        n = int(store.add("ep", 0))
        for k in (n - 1, n):
            if k >= 0 and k not in answered and store.check([f"ep/{k}/open"]):
                answered.add(k)
                mine = Evidence(rank=1, step=3, op_id=1, phase=int(Phase.COLLECTIVE), pending=True, fp_hash=FP[0],
                                fingerprint=FP[1], silent_s=0.1, silent=False, alive=True, seq=99)
                store.set(f"ep/{k}/r/1", json.dumps(mine.to_dict()))
        time.sleep(0.02)


def _trainer(record: ProgressRecord, *, long_s: float, again_s: float) -> None:
    record.publish(3, 1, Phase.COLLECTIVE, True, 1, FP)  # in a long collective that its peer is still far from
    time.sleep(long_s)
    record.publish(3, 1, Phase.COMPUTE)  # done: the silence was the job's rhythm
    time.sleep(again_s)  # the same phase again, shorter than 4 x what was learned
    record.publish(3, 1, Phase.CLOSED)


def test_a_silence_an_episode_found_healthy_is_learned_and_not_diagnosed_again(tmp_path):
    record = create_record("learn", 0, directory=str(tmp_path))
    record.learning = True
    record.publish(1, 0, Phase.FORWARD)
    time.sleep(0.2)
    record.publish(1, 0, Phase.STEP_END)
    record.commit_gaps()  # a healthy rhythm of ~0.2 s: past the warm-up, threshold = the configured 1 s
    store = dist.PrefixStore("scout/learn", dist.HashStore())
    spec = ObserverSpec(run_id="learn", rank=0, world_size=2, record_path=record.path,
                        control=ControlPlane("localhost", 1, "configured"), peer_groups=[[0, 1]],
                        hosts={0: "a", 1: "a"}, devices={}, silence_threshold_s=1.0, gather_timeout_s=1.0,
                        heartbeat_s=0.2, startup_timeout_s=5.0, jsonl_path=None,
                        trainer_pid=os.getppid())  # the loop's "is my trainer alive" looks at a living process
    observer = _Observer(spec, ready_fd=-1)
    observer.record = ProgressRecord(record.path, owner=False)
    observer.store = store
    observer.proto = EpisodeProtocol(store, rank=0, peer_groups=[[0, 1]], hosts=spec.hosts, gather_timeout_s=1.0,
                                     heartbeat_s=0.2)
    stop = threading.Event()
    threads = [threading.Thread(target=_peer_keeps_working, args=(store, stop)),
               threading.Thread(target=_trainer, args=(record,), kwargs={"long_s": 3.0, "again_s": 2.5})]
    handler = signal.getsignal(signal.SIGTERM)
    try:
        for t in threads:
            t.start()
        observer._loop()  # returns when the trainer publishes CLOSED
    finally:
        signal.signal(signal.SIGTERM, handler)
        stop.set()
        for t in threads:
            t.join()
        record.unlink()
    assert 3.0 <= observer._learned_gap < 4.5
    # One episode (the first silence, no verdict); the second silence of 2.5 s is below 4 x 3 s: none.
    assert int(store.add("ep", 0)) == 1
    assert json.loads(store.get("ep/0/verdict"))["verdicts"] == []
