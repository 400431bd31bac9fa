"""The episode protocol over a store: every observer posts, first-come leaders, lost = did not answer,
repeats suppressed, and what an episode costs at scale (the in-process simulation of benchmarks/)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from scale_sim import CountingStore, simulate  # noqa: E402

from scout_core.progress.classify import Evidence  # noqa: E402
from scout_core.progress.episode import EpisodeProtocol  # noqa: E402

GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7]]
HOSTS = {r: f"node{r // 4}" for r in range(8)}


def _observers(store, clock):
    return [EpisodeProtocol(store, rank=r, peer_groups=GROUPS, hosts=HOSTS, gather_timeout_s=10.0,
                            clock=lambda: clock[0])
            for r in range(8)]


def _ev(rank, *, coordinate=(3, 2), pending=True, silent=True, alive=True, seq=10):
    return Evidence(rank=rank, step=coordinate[0], op_id=coordinate[1], phase=7 if pending else 1, pending=pending,
                    fp_hash=5 if pending else 0, fingerprint="all_reduce" if pending else "", silent_s=6.0,
                    silent=silent, alive=alive, seq=seq)


def _episode(obs, evidence, answering):
    """Drive one episode: the answering observers post (in order); the rest never do."""
    starts, roles = {}, {}
    for r in answering:
        starts[r] = obs[r].post(evidence[r])
        roles[r] = obs[r].claim(obs[r].episode)
    n = obs[answering[0]].episode
    for r in answering:
        if roles[r][0]:
            obs[r].lead_group(n, starts[r])
    reporter = next(r for r in answering if roles[r][1])
    outcome = obs[reporter].report(n, starts[reporter])
    others = [obs[r].await_verdict(n, starts[r]) for r in answering if r != reporter]
    return outcome, others


def test_a_working_rank_is_named_by_its_waiting_peers_and_nobody_is_lost():
    store, clock = CountingStore(), [0.0]
    obs = _observers(store, clock)
    ev = {r: _ev(r) for r in range(8)}
    ev[0] = _ev(0, coordinate=(3, 1), pending=False, silent=False)  # rank 0 still evaluating
    outcome, others = _episode(obs, ev, [3, 1, 2, 0, 4, 5, 6, 7])
    assert [(v.hang_class.value, v.ranks) for v in outcome.verdicts] == [("lagging", (0,))]
    assert all([v.ranks for v in o.verdicts] == [(0,)] for o in others)


def test_only_observers_that_never_answer_are_lost_and_a_whole_machine_is_named():
    store, clock = CountingStore(), [0.0]
    obs = _observers(store, clock)
    ev = {r: _ev(r, alive=False) for r in range(4)}  # their trainers crashed when the peers died
    outcome, _ = _episode(obs, ev, [0, 1, 2, 3])
    assert [(v.hang_class.value, v.scope, v.ranks) for v in outcome.verdicts] == [
        ("lost", "machine", (4, 5, 6, 7))]


def test_a_later_episode_over_the_same_stopped_ranks_is_not_reported_again():
    store, clock = CountingStore(), [0.0]
    obs = _observers(store, clock)
    ev = {r: _ev(r) for r in range(8)}
    ev[5] = _ev(5, coordinate=(3, 1), pending=False, seq=44)
    first, _ = _episode(obs, ev, list(range(8)))
    assert not first.repeat and [v.ranks for v in first.verdicts] == [(5,)]
    ev = {r: _ev(r, coordinate=(3, 3), seq=11) for r in range(8)}  # peers moved on and wait again
    ev[5] = _ev(5, coordinate=(3, 1), pending=False, seq=44)  # rank 5 has not moved
    second, _ = _episode(obs, ev, list(range(8)))
    assert second.repeat and [v.ranks for v in second.verdicts] == [(5,)]
    ev = {r: _ev(r, coordinate=(3, 3), seq=12) for r in range(8)}
    ev[5] = _ev(5, coordinate=(3, 1), pending=False, seq=57, silent=False)  # busy at the same point: publishing
    third, _ = _episode(obs, ev, list(range(8)))
    assert third.repeat and [v.ranks for v in third.verdicts] == [(5,)]  # hang-rank0-busy reported it twice
    ev[5] = _ev(5, coordinate=(4, 1), pending=False, seq=80)  # it moved, and stopped again further on
    ev = {**{r: _ev(r, coordinate=(4, 3), seq=13) for r in range(8)}, 5: ev[5]}
    fourth, _ = _episode(obs, ev, list(range(8)))
    assert not fourth.repeat and [v.ranks for v in fourth.verdicts] == [(5,)]


def test_an_episode_costs_each_observer_a_constant_and_a_leader_its_group():
    small, large = simulate(512, mp=8), simulate(4096, mp=8)
    assert small["verdict"] == large["verdict"] == [("lagging", [9])]
    assert small["observer"]["messages_max"] == large["observer"]["messages_max"] <= 8
    assert small["reporter"]["messages_max"] == large["reporter"]["messages_max"]  # one multi_get per group
    assert large["store_messages"] <= 9 * 4096  # about 8 an observer: the sealed open key costs it one get


def test_a_group_whose_leader_never_posts_is_read_by_the_reporter_not_named_lost():
    """Several groups, one member of group 1 dead, and group 1's leader died after posting its evidence."""
    store, clock = CountingStore(), [0.0]
    obs = _observers(store, clock)
    ev = {r: _ev(r) for r in range(8)}
    ev[2] = _ev(2, coordinate=(3, 1), pending=False)  # the frozen rank
    answering = [0, 1, 2, 3, 4, 5, 6]  # rank 7's observer is gone
    starts = {r: obs[r].post(ev[r]) for r in answering}
    roles = {r: obs[r].claim(0) for r in answering}
    assert roles[4] == (True, False)
    obs[0].lead_group(0, starts[0])  # group 0's leader posts; group 1's leader (rank 4) dies here
    outcome = obs[0].report(0, starts[0])
    assert sorted((v.hang_class.value, v.ranks) for v in outcome.verdicts) == [("lagging", (2,)), ("lost", (7,))]


def test_a_leader_does_not_wait_for_members_that_closed():
    """At a job's end the others closed SCOUT; rank 0 is still saving: its leader reads the list of closed
    ranks and decides at once, with no verdict, instead of waiting the gather timeout for them."""
    import time as _time

    from torch.distributed import HashStore

    from scout_core.progress.episode import CLOSED_LIST

    store = HashStore()
    for r in (1, 2, 3):
        store.append(CLOSED_LIST, f"{r},")
    proto = EpisodeProtocol(store, rank=0, peer_groups=[[0, 1, 2, 3]], hosts={}, gather_timeout_s=30.0)
    start = proto.post(_ev(0, pending=False))
    t0 = _time.monotonic()
    proto.lead_group(proto.episode, start)
    assert _time.monotonic() - t0 < 5.0
    import json

    summary = json.loads(store.get(f"ep/{proto.episode}/g/0"))
    assert summary["verdicts"] == [] and summary["lost"] == []


def test_an_episode_deferred_on_a_ranks_io_tells_every_observer_to_try_again():
    """Rank 4 is inside its data fetch (within its tolerance); rank 0 waits behind it (inside a collective, behind
    its peers) and nobody else is named: no verdict, and every observer learns the episode was deferred (its silent
    ones try again after the I/O tolerance: the fetching rank may leave its fetch by closing, and open nothing)."""
    store, clock = CountingStore(), [0.0]
    obs = _observers(store, clock)
    ev = {r: _ev(r, coordinate=(3, 5)) for r in range(8)}
    ev[0] = _ev(0, coordinate=(3, 2))
    ev[4] = Evidence(rank=4, step=3, op_id=1, phase=4, pending=False, fp_hash=0, fingerprint="", silent_s=6.0,
                     silent=False, seq=10)  # phase 4: the data loader
    outcome, others = _episode(obs, ev, list(range(8)))
    assert outcome.verdicts == [] and outcome.deferred and all(o.deferred and o.verdicts == [] for o in others)
    ev[4] = dataclasses.replace(ev[4], silent=True)  # its tolerance ended: it is judged, alone
    outcome, _ = _episode(obs, ev, list(range(8)))
    assert [(v.hang_class.value, v.ranks) for v in outcome.verdicts] == [("data_stall", (4,))]
    assert not outcome.deferred


def test_values_someone_outside_the_job_wrote_name_nobody():
    """Anyone who reaches a TCPStore can list and write its keys. With the job's secret every value a verdict is
    built from is sealed: forged evidence makes the episode name nobody and say why, a forged entry of the
    closed list is ignored, and a forged verdict is not believed."""
    from scout_core.progress.sealed import seal

    store, clock = CountingStore(), [0.0]
    obs = [EpisodeProtocol(store, rank=r, peer_groups=GROUPS, hosts=HOSTS, gather_timeout_s=10.0,
                           clock=lambda: clock[0], secret="f0" * 16) for r in range(8)]
    ev = {r: _ev(r) for r in range(8)}
    ev[5] = _ev(5, coordinate=(3, 1), pending=False, seq=44)  # the real culprit
    store.data["closed"] = b"6,"  # an outsider claims rank 6 closed SCOUT: it is still waited for
    assert obs[0]._closed_ranks() == set()
    for r in range(8):
        obs[r].post(ev[r])
    forged = dataclasses.replace(ev[2], step=3, op_id=0, pending=False, silent=True, seq=99)
    store.data["ep/0/r/2"] = json.dumps(forged.to_dict()).encode()  # "rank 2 is behind"
    starts = {r: clock[0] for r in range(8)}
    roles = {r: obs[r].claim(0) for r in range(8)}
    for r in range(8):
        if roles[r][0]:
            obs[r].lead_group(0, starts[r])
    outcome = obs[0].report(0, starts[0])
    assert [(v.hang_class.value, v.ranks) for v in outcome.verdicts] == [("inconclusive", ())]
    assert "ep/0/r/2" in outcome.verdicts[0].reason and "outside the job" in outcome.verdicts[0].reason
    assert [v.ranks for v in obs[3].await_verdict(0, starts[3]).verdicts] == [()]  # every observer reads the same
    # A verdict written with a guessed secret is not believed either.
    store.data["ep/1/verdict"] = seal("0" * 32, "ep/1/verdict", json.dumps(
        {"verdicts": [{"class": "lagging", "ranks": [7], "peer_group": [4, 5, 6, 7], "reason": "forged",
                       "evidence": {}}]})).encode()
    assert [v.ranks for v in obs[4]._finish(1, obs[4]._read_verdict(1), reporter=False).verdicts] == [()]


def test_sealed_values_leave_the_verdict_as_it_was():
    """The same episode with and without the secret: sealing changes nothing a verdict is built from."""
    for secret in ("", "ab" * 16):
        store, clock = CountingStore(), [0.0]
        obs = [EpisodeProtocol(store, rank=r, peer_groups=GROUPS, hosts=HOSTS, gather_timeout_s=10.0,
                               clock=lambda clock=clock: clock[0], secret=secret) for r in range(8)]
        ev = {r: _ev(r) for r in range(8)}
        ev[0] = _ev(0, coordinate=(3, 1), pending=False, silent=False)
        outcome, others = _episode(obs, ev, [3, 1, 2, 0, 4, 5, 6, 7])
        assert [(v.hang_class.value, v.ranks) for v in outcome.verdicts] == [("lagging", (0,))], secret
        assert all([v.ranks for v in o.verdicts] == [(0,)] for o in others)


def test_an_outsider_cannot_open_resume_or_rewind_episodes():
    """The unsealed parts of the protocol an outsider could write: an open key not sealed by the job opens
    nothing, a forged 'moved' entry does not make the reporter write that progress resumed, a counter set to a
    non-number or wound back never takes an observer back to an earlier episode (whose genuine verdict it would
    read again)."""
    store, clock = CountingStore(), [0.0]
    obs = [EpisodeProtocol(store, rank=r, peer_groups=GROUPS, hosts=HOSTS, gather_timeout_s=10.0,
                           clock=lambda: clock[0], secret="0d" * 16) for r in range(8)]
    store.data["ep/0/open"] = b"3"  # written by someone without the secret
    assert not obs[0].opened()
    store.data.pop("ep/0/open")
    obs[3].open()  # the job's own observer
    assert obs[0].opened()
    store.data["ep/0/moved"] = b"5,5:" + b"0" * 32 + b","
    assert not obs[0].resumed(0)
    obs[5].moved(0)
    assert obs[0].resumed(0)
    obs[0].episode = 4
    store.data["ep"] = b"not a number"
    assert obs[0]._counter() == 4
    store.data["ep"] = b"1"  # wound back
    clock[0] = 1000.0  # past every deadline: the await gives up and moves on
    assert obs[0].await_verdict(4, 0.0) is None and obs[0].episode >= 5


def test_a_counter_set_ahead_by_an_outsider_does_not_split_the_observers():
    """The episode number is sealed: a counter an outsider set far ahead used to take every observer but the
    reporter to that episode, and at the next stall each side named the other lost."""
    store, clock = CountingStore(), [0.0]
    obs = [EpisodeProtocol(store, rank=r, peer_groups=GROUPS, hosts=HOSTS, gather_timeout_s=10.0,
                           clock=lambda: clock[0], secret="3c" * 16) for r in range(8)]
    ev = {r: _ev(r) for r in range(8)}
    ev[5] = _ev(5, coordinate=(3, 1), pending=False, seq=44)
    starts = {r: obs[r].post(ev[r]) for r in range(8)}
    roles = {r: obs[r].claim(0) for r in range(8)}
    for r in range(8):
        if roles[r][0]:
            obs[r].lead_group(0, starts[r])
    store.data["ep"] = b"1000"  # between the leaders' summaries and the verdict
    outcome = obs[0].report(0, starts[0])
    others = [obs[r].await_verdict(0, starts[r]) for r in range(1, 8)]
    assert [v.ranks for v in outcome.verdicts] == [(5,)] and all(o is not None for o in others)
    assert {o.episode for o in obs} == {1}


@pytest.mark.parametrize("server_kind", ["daemon", "torch"])
def test_an_episode_over_the_observers_own_store_client_names_the_silent_machine(server_kind):
    """The protocol over what observers really use: a plain-Python client per observer against the store daemon's
    server (behind the job's secret) and against torch's TCPStore server (a store the user names), with real
    timeouts (the waits for members that never answer end in the client's own timeout)."""
    import socket
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from scout_core.progress.store_client import PlainStore
    from scout_core.progress.store_server import StoreServer

    secret = "job"
    if server_kind == "torch":
        server = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10))  # served while referenced
        port, given = server.port, ""
    else:
        server = StoreServer(socket.create_server(("127.0.0.1", 0)), secret)
        port, given = server.listener.getsockname()[1], secret
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                server.serve(0.05)

        threading.Thread(target=serve, daemon=True).start()
    obs = [EpisodeProtocol(PlainStore("127.0.0.1", port, timeout_s=5, prefix="scout/run", secret=given), rank=r,
                           peer_groups=GROUPS, hosts=HOSTS, gather_timeout_s=0.5, heartbeat_s=0.1, secret=secret)
           for r in range(8)]
    ev = {r: _ev(r, alive=False) for r in range(4)}
    outcome, _ = _episode(obs, ev, [0, 1, 2, 3])
    if server_kind == "daemon":
        stop.set()
    assert [(v.hang_class.value, v.scope, v.ranks) for v in outcome.verdicts] == [
        ("lost", "machine", (4, 5, 6, 7))]
