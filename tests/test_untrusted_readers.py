"""Every reader of a file or message SCOUT did not just write itself, fed arbitrary bytes and arbitrary JSON
(issue 32, item 6): each returns what it parsed or raises SCOUT's own error naming the file, never another
exception, and none deletes or overwrites a good file."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PROFILE = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12)
json_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _json_like(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Documents shaped almost like the real thing: the expected keys with arbitrary values, some missing."""
    return st.fixed_dictionaries({}, optional={k: v | json_values for k, v in fields.items()})


_deep = st.integers(1000, 200_000).map(lambda n: b"[" * n)  # json.loads raises RecursionError, not ValueError


def _file_bytes(shaped: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    return (st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode())
            | shaped.map(lambda v: json.dumps(v).encode()) | _deep)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


# -- incident records -------------------------------------------------------------------------------------------

@PROFILE
@given(line=st.text(max_size=200) | _deep.map(bytes.decode)
       | _json_like({"kind": st.sampled_from(["hang", "sdc"]), "scope": st.just("rank"),
                     "ranks": st.lists(st.integers()), "hosts": json_values,
                     "step": st.integers(), "reason": st.text()}).map(json.dumps))
def test_an_incident_line_parses_or_raises_a_record_error(line):
    from scout_core.report import Incident, RecordError, parse_incident

    try:
        assert isinstance(parse_incident(line, "f:1"), Incident)
    except RecordError as exc:
        assert str(exc).startswith("f:1")


# -- decisions (the checkpoint coordinator's log) ---------------------------------------------------------------

@PROFILE
@given(lines=st.lists(st.text(max_size=40) | json_values.map(json.dumps) | _deep.map(bytes.decode), max_size=6))
def test_decision_records_are_objects_whatever_the_file_holds(tmp_path, lines):
    from scout_core.checkpoint.coordinator import read_records

    path = tmp_path / "decisions.jsonl"
    path.write_text("\n".join(lines), encoding="utf-8")
    assert all(isinstance(r, dict) for r in read_records(str(path)))


# -- framework checkpoint labels ---------------------------------------------------------------------------------

_entry = _json_like({"label": st.sampled_from(["latest", "candidate", "verified", "rejected"]),
                     "ended": st.booleans(), "path": st.text(max_size=8)})
_labels = _json_like({"checkpoints": st.dictionaries(st.integers(0, 50).map(str) | st.text(max_size=4), _entry,
                                                     max_size=4),
                      "stopped_for": st.sampled_from(["sdc", "straggler", "other"]),
                      "set_aside": st.lists(st.text(max_size=6), max_size=2), "ended_normally": st.booleans()})


@PROFILE
@given(data=_file_bytes(_labels))
def test_checkpoint_labels_from_any_file_give_a_choice_and_stay_on_disk(tmp_path, data):
    from scout_core.checkpoint.certify import Certifier
    from scout_core.checkpoint.durable import LABELS_FILE, FrameworkCheckpoints

    folder = tmp_path / f"run-{abs(hash(data))}"
    _write(folder / LABELS_FILE, data)
    labels = FrameworkCheckpoints(str(folder), writer=True)
    for failure in (None, "sdc", "straggler"):
        choice = labels.choose(failure)
        assert choice.step is None or choice.step in labels.entries
    labels.verified_at(100)
    assert (folder / LABELS_FILE).read_bytes() == data  # reading never rewrites it
    labels.saved(7, str(folder / "step-7"), Certifier())  # a save beside entries read from the file
    assert labels.entries[7]["path"] == str(folder / "step-7")


# -- the durable store's sidecars ----------------------------------------------------------------------------------

@PROFILE
@given(data=_file_bytes(_json_like({"generation": st.just(1), "world_size": st.just(2), "bytes": st.integers(),
                                    "sha256": st.text(max_size=64), "role": st.text(max_size=8)})))
def test_a_sidecar_of_any_content_is_a_shard_not_committed(tmp_path, data):
    from scout_core.checkpoint.store import DurableStore

    root = tmp_path / f"store-{abs(hash(data))}"
    store = DurableStore(str(root), rank=0, world_size=2)
    _, sidecar = store._paths(1)
    _write(Path(sidecar), data)
    _write(Path(store._paths(1)[0]), b"payload")
    generations = store.local_generations()
    assert set(generations) <= {1}


# -- the hosts-to-exclude file -----------------------------------------------------------------------------------

_exclusions = _json_like({"hosts": st.lists(st.text(max_size=5)), "ranks": st.lists(st.integers(0, 9)),
                          "drain": st.lists(st.text(max_size=5)),
                          "verdicts": st.lists(_json_like({"kind": st.sampled_from(["hang", "sdc"]),
                                                           "scope": st.sampled_from(["rank", "machine"]),
                                                           "ranks": st.lists(st.integers(0, 9)),
                                                           "hosts": st.lists(st.text(max_size=5))}), max_size=3)})


@PROFILE
@given(data=_file_bytes(_exclusions))
def test_an_exclusions_file_is_merged_or_refused_and_never_lost(tmp_path, data):
    from scout_core.actions import ExclusionsError, record_exclusions

    path = tmp_path / f"exclude-{abs(hash(data))}.json"
    _write(path, data)
    verdict = {"kind": "hang", "scope": "rank", "ranks": [3], "hosts": ["node-a"], "step": 7, "surface": "",
               "reason": "r"}
    try:
        merged = record_exclusions(str(path), [verdict])
    except ExclusionsError as exc:
        assert str(path) in str(exc)
        assert path.read_bytes() == data  # refused: left as it was
        return
    assert "node-a" in merged["hosts"] and 3 in merged["ranks"]
    assert json.loads(path.read_text()) == merged


# -- the MoE shape catalog -----------------------------------------------------------------------------------------

@PROFILE
@given(data=_file_bytes(_json_like({"format": st.just("scout-moe-catalog"), "version": st.integers(0, 3),
                                    "environment": json_values, "entries": json_values})))
def test_a_catalog_file_loads_or_raises_a_value_error_naming_it(tmp_path, data):
    from scout_core.moe.catalog import CATALOG_FORMAT, CATALOG_VERSION, Catalog

    path = tmp_path / f"catalog-{abs(hash(data))}.json"
    text = data.replace(b'"scout-moe-catalog"', json.dumps(CATALOG_FORMAT).encode())
    text = text.replace(b'"version": 1', f'"version": {CATALOG_VERSION}'.encode())
    _write(path, text)
    try:
        catalog = Catalog.load(str(path))
    except ValueError as exc:
        assert str(path) in str(exc)
        return
    assert isinstance(catalog.environment, dict) and isinstance(catalog.entries, (dict, list))


# -- runtime control: a command's answer ---------------------------------------------------------------------------

@PROFILE
@given(lines=st.lists(st.text(max_size=30) | json_values.map(json.dumps), max_size=5))
def test_scout_ctl_reads_any_answers_file(tmp_path, lines, monkeypatch):
    from scout_core import control

    folder = tmp_path / f"ctl-{abs(hash(tuple(lines)))}"
    folder.mkdir(exist_ok=True)
    (folder / "applied.jsonl").write_text("\n".join(lines))
    monkeypatch.setattr(control, "_run_folder", lambda run, directory: folder)
    answer = control.wait_applied("run", "abc", timeout_s=0.05)
    assert answer is None or (isinstance(answer, dict) and answer.get("id") == "abc")


# -- messages from peers and saved calls ---------------------------------------------------------------------------

@PROFILE
@given(data=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_wire_payloads_decode_or_raise_a_wire_error(data):
    from scout_core.wire import WireError, decode

    try:
        decode(data)
    except WireError:
        pass


@PROFILE
@given(doc=json_values)
def test_a_saved_call_decodes_or_raises_a_wire_error(doc):
    from scout_core.replay.spec_codec import decode_spec
    from scout_core.wire import WireError

    try:
        decode_spec(doc)
    except WireError:
        pass


@PROFILE
@given(data=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_replay_metadata_from_a_peer_decodes_or_raises_a_wire_error(data):
    from scout_core.replay.spec_codec import decode_metadata
    from scout_core.wire import WireError

    try:
        decode_metadata(data, src=1)
    except WireError:
        pass


@PROFILE
@given(data=st.binary(max_size=80) | st.text(max_size=40).map(str.encode))
def test_a_checkpoint_folders_nonce_reads_or_raises_a_value_error_naming_it(tmp_path, data):
    from scout_core.checkpoint.memory import NONCE, read_nonce

    folder = tmp_path / f"ckpt-{abs(hash(data))}"
    _write(folder / NONCE, data)
    try:
        nonce = read_nonce(str(folder))
    except ValueError as exc:
        assert str(folder / NONCE) in str(exc)
        return
    assert nonce is not None and nonce == data.decode().strip()


@PROFILE
@given(record=_json_like({"record": st.just("decision"), "binding": st.booleans(),
                          "certifier": _json_like({"latest": st.integers(0, 9) | st.none()}),
                          "generation": st.integers(0, 9) | st.none(),
                          "source": st.sampled_from(["latest", "verified"]), "reason": st.text(max_size=8)}))
def test_a_decision_record_of_any_shape_binds_a_restart_only_when_whole(record):
    from scout_core.checkpoint.resume import _binding

    if _binding(record, 3):  # used as the restart's decision: its fields must be there, typed
        assert record.get("source") in ("latest", "verified")
        assert isinstance(record.get("generation"), (int, type(None)))
