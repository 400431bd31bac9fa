"""What a cell's incident records get wrong against its ``expect`` (test machinery shared by the cells)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["record_problems"]


def record_problems(incidents: Sequence[Any], expect: Mapping[str, Any]) -> list[str]:
    """Exact ranks and kinds (none expected: none reported), one scope (``rank`` unless said), and where given:
    the number of records, surfaces each named by some record (and ``not_surfaces`` by none), hosts, the steps of
    the records, the first step at the latest, each named rank's first step at the latest, and the hang class."""
    problems = []
    named = sorted({r for i in incidents for r in i.ranks})
    if sorted(expect.get("ranks", [])) != named:
        problems.append(f"named ranks {named}, expected {expect.get('ranks', [])}")
    if "count" in expect and len(incidents) != expect["count"]:  # e.g. a job-wide verdict recorded once
        problems.append(f"{len(incidents)} records, expected {expect['count']}")
    kinds = sorted({i.kind.value for i in incidents})
    if sorted(expect.get("kinds", [])) != kinds:
        problems.append(f"kinds {kinds}, expected {expect.get('kinds', [])}")
    scopes = sorted({i.scope.value for i in incidents})
    if incidents and scopes != [expect.get("scope", "rank")]:
        problems.append(f"scopes {scopes}, expected {expect.get('scope', 'rank')} only")
    surfaces = sorted({s for i in incidents for s in i.surface.split(";")})
    for needle in expect.get("surfaces", []):
        if not any(needle in s for s in surfaces):
            problems.append(f"no incident on a surface containing {needle!r}; got {surfaces[:6]}")
    for forbidden in expect.get("not_surfaces", []):
        if any(forbidden in s for s in surfaces):
            problems.append(f"unexpected incident on {forbidden!r}: {surfaces}")
    if "hosts" in expect and sorted({h for i in incidents for h in i.hosts}) != sorted(expect["hosts"]):
        problems.append(f"hosts {sorted({h for i in incidents for h in i.hosts})}, expected {expect['hosts']}")
    if "steps" in expect and sorted({i.step for i in incidents}) != sorted(expect["steps"]):
        problems.append(f"incidents at steps {sorted({i.step for i in incidents})}, expected {expect['steps']}")
    if "within_steps" in expect and incidents and min(i.step for i in incidents) > expect["within_steps"]:
        problems.append(f"first incident at step {min(i.step for i in incidents)}, expected within "
                        f"{expect['within_steps']} steps")
    if "first_named" in expect:  # each named rank's first record, at the step given or before
        first = {r: min(i.step for i in incidents if r in i.ranks) for r in named}
        late = {r: first.get(int(r)) for r, at in expect["first_named"].items() if first.get(int(r), 1 << 30) > at}
        if late:
            problems.append(f"first named at {late}, expected by {expect['first_named']}; all: {first}")
    if "class" in expect:
        classes = sorted({str(i.evidence.get("class")) for i in incidents})
        if classes != [expect["class"]]:
            problems.append(f"hang classes {classes}, expected {expect['class']}")
    return problems
