"""Incident records: schema round trip, atomic JSON-lines appends, sinks and `scout report`."""

from __future__ import annotations

import json
import logging
import os

import pytest

from scout_core.cli import main
from scout_core.report import (
    Incident,
    IncidentKind,
    IncidentScope,
    JsonlSink,
    LoggingSink,
    Reporter,
    format_table,
    read_incidents,
)


def _incident(**kw):
    base = dict(kind="sdc", scope="rank", ranks=[9], hosts=["node1"], devices=["cuda:1"], step=12,
                surface="layers.3.output", evidence={"status": "attributed", "bitmap": [0, 1]},
                time_to_verdict_s=0.25, reason="signature differs")
    base.update(kw)
    return Incident(**base)


def test_round_trip_and_enums():
    inc = _incident()
    assert inc.kind is IncidentKind.SDC and inc.scope is IncidentScope.RANK
    again = Incident.from_dict(json.loads(inc.to_json()))
    assert again == inc
    with pytest.raises(ValueError):
        _incident(kind="meltdown")
    with pytest.raises(ValueError, match="unknown incident fields"):
        Incident.from_dict({**inc.to_dict(), "extra": 1})


def test_every_kind_and_scope_is_representable():
    for kind in IncidentKind:
        for scope in IncidentScope:
            assert Incident.from_dict(_incident(kind=kind.value, scope=scope.value).to_dict()).kind is kind


def test_jsonl_sink_and_reporter_stamp(tmp_path):
    path = tmp_path / "sub" / "incidents.jsonl"
    rep = Reporter([JsonlSink(path)], run_id="run-7", rank=3)
    rep.emit(_incident())
    rep.emit(_incident(kind="straggler", scope="machine", ranks=[4], hosts=["node4"]))
    got = list(read_incidents(path))
    assert [i.kind.value for i in got] == ["sdc", "straggler"]
    assert {i.run_id for i in got} == {"run-7"} and {i.reporter_rank for i in got} == {3}
    assert got[0].version


def test_concurrent_appends_never_interleave(tmp_path):
    path = tmp_path / "shared.jsonl"
    writers, per_writer = 6, 150
    pids = []
    for w in range(writers):
        pid = os.fork()
        if pid == 0:
            sink = JsonlSink(path, fsync=False)
            try:
                for i in range(per_writer):
                    sink.emit(_incident(step=i, reason="x" * (w * 500), ranks=[w]))
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    lines = path.read_text().splitlines()
    assert len(lines) == writers * per_writer
    records = [json.loads(line) for line in lines]  # every line is one whole record
    for w in range(writers):
        assert sorted(r["step"] for r in records if r["ranks"] == [w]) == list(range(per_writer))


def test_truncated_last_line_is_skipped_but_corruption_elsewhere_raises(tmp_path):
    path = tmp_path / "i.jsonl"
    JsonlSink(path).emit(_incident())
    with open(path, "a") as fh:
        fh.write('{"kind": "sdc", "sco')
    assert len(list(read_incidents(path))) == 1
    path.write_text('garbage\n' + _incident().to_json() + "\n")
    with pytest.raises(ValueError, match=":1:"):
        list(read_incidents(path))


def test_logging_sink(caplog):
    with caplog.at_level(logging.WARNING, logger="scout"):
        LoggingSink().emit(_incident())
    assert "sdc scope=rank ranks=[9]" in caplog.text


def test_the_log_line_summarises_a_long_surface_list_and_the_record_keeps_it(caplog, tmp_path):
    many = ";".join(f"layers.1.x{i}.output" for i in range(9))
    with caplog.at_level(logging.WARNING, logger="scout"):
        LoggingSink().emit(_incident(surface=many))
        LoggingSink().emit(_incident(surface="a;b;c"))
    assert "surface=layers.1.x0.output;layers.1.x1.output (+7 more): " in caplog.text
    assert "surface=a;b;c: " in caplog.text
    JsonlSink(tmp_path / "i.jsonl").emit(_incident(surface=many))
    assert next(read_incidents(tmp_path / "i.jsonl")).surface == many


def test_reporter_survives_one_broken_sink(tmp_path, caplog):
    class Broken:
        def emit(self, incident):
            raise OSError("disk gone")

    path = tmp_path / "ok.jsonl"
    Reporter([Broken(), JsonlSink(path)]).emit(_incident())
    assert len(list(read_incidents(path))) == 1
    with pytest.raises(RuntimeError, match="every incident sink failed"):
        Reporter([Broken()]).emit(_incident())


def test_scout_report_prints_table(tmp_path, capsys):
    path = tmp_path / "i.jsonl"
    sink = JsonlSink(path)
    sink.emit(_incident())
    sink.emit(_incident(kind="hang", scope="peer_group", ranks=[0, 1, 2, 3], surface="all_reduce"))
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "kind" in out and "sdc" in out and "peer_group" in out and "0-3" in out
    assert main(["report", str(path), "--kind", "hang"]) == 0
    assert "sdc" not in capsys.readouterr().out.split("\n", 2)[2]
    assert main(["report", str(tmp_path / "missing.jsonl")]) == 2


def test_empty_table():
    assert format_table([]) == "no incidents"


@pytest.mark.parametrize("line, message", [
    ('{"kind": "sdc", "ranks": [9]}', "missing field(s) scope"),  # was a TypeError traceback
    ('{"kind": "sdc", "scope": "rank"}', "missing field(s) ranks"),
    ('{"kind": "melted", "scope": "rank", "ranks": [1]}', "'melted' is not a valid IncidentKind"),
    ('{"kind": "sdc", "scope": "rank", "ranks": [1], "colour": "red"}', "unknown incident fields"),
    ('[1, 2]', "a record is a JSON object, got list"),
    ('{"kind": "sdc", "scope": "rank", "ranks": 7}', "ranks"),
    ('not json', "not JSON"),
    ('{"kind": "sdc", "scope": "rank", "ranks": [1], "hosts": "node-a"}', "hosts must be a list of machine names"),
    ('{"kind": "sdc", "scope": "rank", "ranks": [1], "hosts": null}', "hosts must be"),
    ('{"kind": "sdc", "scope": "rank", "ranks": [1], "step": "7"}', "step must be a step number or null"),
    ('{"kind": "sdc", "scope": "rank", "ranks": [1], "surface": ["a"]}', "surface must be a string"),
    ('{"kind": "sdc", "scope": "rank", "ranks": [1], "reason": null}', "reason must be a string"),
    ('{"kind": "sdc", "scope": "rank", "ranks": [1], "time_unix": NaN}', "time_unix must be a Unix time"),
    ('{"kind": "sdc", "scope": "rank", "ranks": [1], "time_unix": 1e300}', "time_unix must be a Unix time"),
    ('{"kind": "sdc", "scope": "rank", "ranks": [1], "time_to_verdict_s": "1"}', "time_to_verdict_s must be"),
    ('{"kind": "sdc", "scope": "rank", "ranks": [true]}', "ranks must be a list of rank numbers"),
    ('{"kind": "sdc", "scope": "rank", "ranks": [-5]}', "ranks must be a list of rank numbers (0 or more)"),
])
def test_scout_report_names_the_bad_line_without_a_traceback(tmp_path, capsys, line, message):
    """The bad line is named and skipped; the records around it still count (exit status 1: something was
    skipped). A torn append must not hide a machine to drain."""
    path = tmp_path / "i.jsonl"
    path.write_text(_incident().to_json() + "\n" + line + "\n" + _incident(hosts=["node2"]).to_json() + "\n")
    assert main(["report", str(path)]) == 1
    out, err = capsys.readouterr()
    assert f"{path}:2: " in err and message in err and "skipped" in err and "Traceback" not in err
    assert "node1" in out and "node2" in out
    assert main(["hosts-to-exclude", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out.split() == ["node1", "node2"] and f"{path}:2: " in err


def test_a_truncated_last_record_is_reported_with_its_line(tmp_path, capsys):
    path = tmp_path / "i.jsonl"
    path.write_text(_incident().to_json() + "\n" + '{"kind": "sdc", "sco')
    assert main(["report", str(path)]) == 0
    captured = capsys.readouterr()
    assert f"{path}:2: a truncated last record was skipped" in captured.err and "sdc" in captured.out


def test_repeated_records_of_one_fault_are_one_row():
    records = [_incident(step=s, surface=f"layers.{s % 3}.x1.output") for s in (4, 5, 6, 7)]
    records.append(_incident(ranks=[3], step=6))
    table = format_table(records)
    rows = table.splitlines()[2:]
    assert len(rows) == 2
    assert " 4  " in rows[0] and "4..7" in rows[0] and "(+2)" in rows[0]  # 4 records, 3 surfaces
    assert len(format_table(records, group=False).splitlines()) == 2 + 5


def test_rows_fit_the_terminal_and_the_json_keeps_the_detail():
    long = _incident(surface=";".join(f"layers.{i}.x10.grad_param" for i in range(40)), reason="r" * 500,
                     ranks=list(range(64)), hosts=[f"node{i // 8}" for i in range(64)])
    table = format_table([long], width=120)
    assert max(len(line) for line in table.splitlines()) <= 120
    assert "node0,node1 (+6)" in table and "0-63" in table
    assert "layers.0.x10.grad_param;layers.1.x10.grad_param (+38 more)" in format_table([long], width=200)
    assert len(format_table([long], width=None).splitlines()[2]) > 1000
    scattered = _incident(kind="checkpoint_stall", scope="machine", ranks=list(range(0, 128, 2)),
                          hosts=[f"a-very-long-hostname-{i}.cluster.example" for i in range(64)], reason="x" * 300)
    assert max(len(line) for line in format_table([scattered], width=120).splitlines()) <= 120


def test_hosts_to_exclude_lists_sdc_and_slow_machines_once(tmp_path, capsys):
    path = tmp_path / "i.jsonl"
    sink = JsonlSink(path)
    sink.emit(_incident(hosts=["node1"]))  # SDC on rank 9
    sink.emit(_incident(hosts=["node1"], step=8))  # the same again
    sink.emit(_incident(kind="straggler", scope="machine", ranks=[4, 5], hosts=["node0", "node0"]))
    sink.emit(_incident(kind="straggler", scope="rank", ranks=[12], hosts=["node3"]))  # one slow rank: no
    sink.emit(_incident(kind="sdc", scope="peer_group", ranks=[6, 7], hosts=["node5", "node6"]))  # no culprit
    sink.emit(_incident(kind="hang", scope="rank", ranks=[2], hosts=["node7"]))  # for a restart to clear
    assert main(["hosts-to-exclude", str(path)]) == 0
    assert capsys.readouterr().out == "node0\nnode1\n"
    empty = tmp_path / "clean.jsonl"
    empty.write_text("")
    assert main(["hosts-to-exclude", str(empty)]) == 0
    assert capsys.readouterr().out == ""


def test_one_rank_on_different_machines_or_runs_is_not_one_fault():
    records = [_incident(hosts=["node-a"], run_id="run1"), _incident(hosts=["node-b"], run_id="run2"),
               _incident(hosts=["node-a"], run_id="run1", step=20, reason="again\nand again")]
    rows = format_table(records).splitlines()[2:]
    assert len(rows) == 2 and "node-a" in rows[0] and "node-b" in rows[1] and " 2  " in rows[0]
    assert "again and again" not in format_table(records)  # the group shows its first record's reason
    assert all("\n" not in r for r in format_table(records, group=False).splitlines())


def test_scout_plugins_lists_each_plugin_and_why_one_is_unusable(monkeypatch, capsys):
    """`scout plugins` reads the scout.plugins entry-point group: a plugin's framework version against its tested
    range and how to turn it on; a plugin whose version gate refuses the installed framework, with why (status 1)."""
    from importlib import metadata
    from types import SimpleNamespace

    from scout_core import cli

    good = SimpleNamespace(name="fw", framework="framework", framework_version="1.2", supported=">=1,<2",
                           how="--scout")

    def refuse():
        raise ImportError("scout-other supports other >=2; other 1.0 is installed")

    eps = [SimpleNamespace(name="other", load=refuse), SimpleNamespace(name="fw", load=lambda: good)]
    monkeypatch.setattr(metadata, "entry_points", lambda group: eps if group == cli.PLUGIN_GROUP else [])
    assert cli.main(["plugins"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == ["fw: framework 1.2 (tested: >=1,<2)", "  --scout",
                   "other: unusable: ImportError: scout-other supports other >=2; other 1.0 is installed"]
    monkeypatch.setattr(metadata, "entry_points", lambda group: [])
    assert cli.main(["plugins"]) == 0 and "no SCOUT plugins installed" in capsys.readouterr().out


def test_the_restart_list_and_the_drain_list_agree_on_what_to_drain(tmp_path):
    """exclude_hosts.json's ``drain`` is what ``scout hosts-to-exclude`` prints; its ``hosts`` also keep the
    machines of a hang or stall, which the restart leaves out but a scheduler need not drain."""
    from scout_core.actions import record_exclusions, verdict_summary
    from scout_core.report import hosts_to_exclude

    records = [_incident(hosts=["node1"]), _incident(kind="hang", ranks=[3], hosts=["node0"]),
               _incident(kind="data_stall", ranks=[5], hosts=["node2"]),
               _incident(kind="straggler", scope="machine", ranks=[8, 9], hosts=["node4", "node4"]),
               _incident(kind="sdc", scope="peer_group", ranks=[0, 1], hosts=["node0", "node0"])]
    current = record_exclusions(str(tmp_path / "exclude_hosts.json"), [verdict_summary(i) for i in records])
    assert current["drain"] == hosts_to_exclude(records) == ["node1", "node4"]
    assert current["hosts"] == ["node0", "node1", "node2", "node4"]
    old = tmp_path / "old.json"  # a file from before the drain list: its verdicts still name the machines
    old.write_text(json.dumps({"hosts": ["node1"], "ranks": [9], "verdicts": [verdict_summary(records[0])]}))
    assert record_exclusions(str(old), [verdict_summary(records[1])])["drain"] == ["node1"]


def test_a_stop_writes_the_verdict_where_torchrun_reads_its_root_cause(tmp_path, monkeypatch):
    """torchrun's summary reads a failed worker's error file with its own ProcessFailure: the message it prints
    is SCOUT's verdict, whatever the exit status or signal."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from scout_core.actions import LAUNCHER_ERROR_FILE_ENV, stop_message, write_launcher_error

    summary = {"kind": "sdc", "scope": "rank", "ranks": [9], "hosts": ["node1"], "step": 200, "surface": "",
               "reason": "its replay of layers.1 disagreed with 15 replicas"}
    message = stop_message([summary], how="exit status 75", records="/runs/incidents.jsonl")
    assert message.startswith("SCOUT stopped this job (exit status 75) on its verdict: silent data corruption on "
                              "rank 9 (machine node1) at step 200: its replay of layers.1 disagreed")
    assert "scout report /runs/incidents.jsonl" in message
    monkeypatch.delenv(LAUNCHER_ERROR_FILE_ENV, raising=False)
    assert not write_launcher_error(message)  # no launcher asked for one: nothing written
    path = tmp_path / "error.json"
    monkeypatch.setenv(LAUNCHER_ERROR_FILE_ENV, str(path))
    assert write_launcher_error(message)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(path))
    assert failure.message["extraInfo"]["py_callstack"] == message
    assert list(tmp_path.iterdir()) == [path]  # written whole (no temporary left)
    assert not write_launcher_error(message, str(tmp_path / "missing" / "error.json"))  # never raises
