"""Developer sessions. Every install pins torch through constraints.txt (PIP_CONSTRAINT
also reaches isolated build environments), so a CPU machine never pulls a CUDA build."""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
CONSTRAINTS = {"PIP_CONSTRAINT": str(ROOT / "constraints.txt")}

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True


def _install(session: nox.Session, extras: str = "dev", *, frameworks: bool = False) -> None:
    """docker/install.sh into the session's virtual environment: scout-core with ``extras`` and, with
    ``frameworks``, the three plugins and the framework releases they are tested with (the install the Docker
    images run, so CI tests it on every submission)."""
    args = ["--extras", extras] + ([] if frameworks else ["--core-only"])
    session.run("bash", str(ROOT / "docker" / "install.sh"), *args, env=CONSTRAINTS, external=True)


@nox.session
def tests(session: nox.Session) -> None:
    """docker/test.sh (what CI and docker/Dockerfile.cpu run): the unit and property tests beside the plugins'
    tests (two lanes); every test that mostly waits, three at a time (hangs, stalls, their guards); then, alone,
    the other torchrun tests and the cells of fewer than 16 ranks; the whole fault matrix (every cell with a matrix
    place: runs/matrix.*; hangs and stalls three at a time); the other guards.
    ``nox -s tests -- ARGS`` runs pytest over tests/ and integrations_tests/ with ARGS, and nothing else."""
    _install(session, "dev,bench", frameworks=True)
    session.run("bash", str(ROOT / "docker" / "test.sh"), *session.posargs, external=True)


@nox.session
def guards(session: nox.Session) -> None:
    """The guards, as CI runs them: each re-runs a cell with one mechanism removed and must see it turn red; those
    of waiting cells (marked ``waits``) three at a time (CI runs them beside its other waiting tests), then the others
    one at a time (75 guards: 13 and 62; the 62 took 632 s in CI here)."""
    _install(session, "dev", frameworks=True)
    env = {"OMP_NUM_THREADS": "1"}
    # ARGS that select guards of one group only (-k, a node id) leave the other run empty: pytest's exit 5.
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", "-n", "3", "-m", "guards and waits", "-q",
                "--durations=10", "integrations_tests/test_cells.py", *session.posargs, env=env, success_codes=[0, 5])
    session.run("python", "-m", "pytest", "-m", "guards and not waits", "-q", "--durations=40",
                "integrations_tests/test_cells.py", *session.posargs, env=env, success_codes=[0, 5])


@nox.session
def cells(session: nox.Session) -> None:
    """Every cell of configs/cells.yaml at its configured world size (the plugins' cells need their frameworks);
    JSON in runs/cells.json, each cell's incident records and output.log in runs/cells/<cell>."""
    _install(session, frameworks=True)
    session.run("scout", "cells", "run", "--all", "--json", "runs/cells.json", "--workdir", "runs/cells",
                *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def matrix(session: nox.Session) -> None:
    """The fault matrix: every cell with a matrix place (every 16-rank one) by layout and fault class
    (``nox -s matrix -- NAME...``: only those), with every framework installed; writes runs/matrix.json,
    runs/matrix.md (Table 3) and runs/matrix.png, and keeps each cell's incident records and output.log in
    runs/cells/<cell>."""
    _install(session, "dev,bench", frameworks=True)
    session.run("scout", "cells", "matrix", "--lanes", "3", *session.posargs, "--out", "runs",
                "--workdir", "runs/cells", env={"OMP_NUM_THREADS": "1"})


@nox.session
def demo(session: nox.Session) -> None:
    """A 16-rank job with every SCOUT feature on and a defective unit on one rank mid-run: the verdict, the stop,
    the restart from the verified checkpoint, the incident table and the HTML report (examples/demo.py)."""
    _install(session)
    session.run("python", "examples/demo.py", "--out", "runs/demo", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks as ratios within one run; writes benchmarks/results.json (and the replay curve's PNG)."""
    _install(session, "dev,bench")
    # The shape catalog's tests first: its benchmark section reports what the tested compression selects.
    session.run("python", "-m", "pytest", "-q", "tests/test_moe_catalog.py")
    session.run("python", "benchmarks/run.py", "--out", "benchmarks/results.json", *session.posargs)


@nox.session
def campaign(session: nox.Session) -> None:
    """300 defects across DDP, FSDP2 and HSDP (6 and 8 ranks), localized at the shipped defaults, then 100 defects
    stopped and restarted at the shipped defaults; results in benchmarks/{campaign,recovery_campaign}.json and the
    README."""
    _install(session)
    session.run("python", "-m", "integrations_tests.campaign", "--out", "benchmarks/campaign.json",
                "--readme", "README.md", *session.posargs, env={"OMP_NUM_THREADS": "1"})
    session.run("python", "-m", "integrations_tests.recovery_campaign", "--out", "benchmarks/recovery_campaign.json",
                "--readme", "README.md", env={"OMP_NUM_THREADS": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff", env=CONSTRAINTS)
    session.run("ruff", "check", "scout_core", "tests", "integrations_tests", "benchmarks", "plugins", "examples",
                "docs", "noxfile.py")
