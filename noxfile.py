"""Developer sessions. Every install pins torch through constraints.txt (PIP_CONSTRAINT
also reaches isolated build environments), so a CPU machine never pulls a CUDA build."""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
CONSTRAINTS = {"PIP_CONSTRAINT": str(ROOT / "constraints.txt")}

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True


def _install(session: nox.Session, extras: str = "dev") -> None:
    session.install("-e", f".[{extras}]", env=CONSTRAINTS)


TORCHTITAN = "torchtitan==0.3.0"
"""The TorchTitan release scout-torchtitan is tested with."""


def _install_torchtitan(session: nox.Session) -> None:
    """TorchTitan (without its declared dependencies: they admit a newer torch) and the plugin."""
    plugin = ROOT / "plugins" / "scout-torchtitan"
    session.install("-r", str(plugin / "requirements.txt"), env=CONSTRAINTS)
    session.install("--no-deps", TORCHTITAN, env=CONSTRAINTS)
    session.install("--no-deps", "-e", str(plugin), env=CONSTRAINTS)


MEGATRON_CORE = "megatron-core==0.19.2"
"""The Megatron-Core release scout-megatron is tested with."""


def _install_megatron(session: nox.Session) -> None:
    """Megatron-Core and the plugin. megatron-core 0.19 declares Python >= 3.12 but ships 3.11 wheels: it goes in
    alone with --no-deps --ignore-requires-python (on a shared line that flag makes pip choose numpy builds meant
    for 3.12), after the modules it imports."""
    plugin = ROOT / "plugins" / "scout-megatron"
    session.install("-r", str(plugin / "requirements.txt"), env=CONSTRAINTS)
    session.install("--no-deps", "--ignore-requires-python", MEGATRON_CORE, env=CONSTRAINTS)
    session.install("--no-deps", "-e", str(plugin), env=CONSTRAINTS)


def _install_deepspeed(session: nox.Session) -> None:
    """DeepSpeed (the release plugins/scout-deepspeed/requirements.txt names) and the plugin. deepspeed builds from
    its sdist: torch (already installed, pinned) must be visible to its setup.py (--no-build-isolation), and none
    of its kernels is compiled (DS_BUILD_OPS=0: on a GPU they are built on first use)."""
    plugin = ROOT / "plugins" / "scout-deepspeed"
    session.install("setuptools>=69", "wheel", env=CONSTRAINTS)  # its build, without isolation, runs here
    session.install("--no-build-isolation", "-r", str(plugin / "requirements.txt"),
                    env={**CONSTRAINTS, "DS_BUILD_OPS": "0"})
    session.install("--no-deps", "-e", str(plugin), env=CONSTRAINTS)


@nox.session
def tests(session: nox.Session) -> None:
    """Unit and property tests plus the fast 16-rank cells, and the plugins' tests."""
    _install(session)
    _install_torchtitan(session)
    _install_megatron(session)
    _install_deepspeed(session)
    session.run("python", "-m", "pytest", "-m", "not cells", "-q", "--durations=60", *session.posargs,
                env={"OMP_NUM_THREADS": "1"})
    # The plugins' tests in a process of their own: the cells fork their ranks from the test process, which
    # must not carry a framework's imports (threads, allocators, hooks) into scout_core's own cells.
    for plugin in ("scout-torchtitan", "scout-megatron", "scout-deepspeed"):
        session.run("python", "-m", "pytest", "-q", f"plugins/{plugin}/tests", env={"OMP_NUM_THREADS": "1"})


@nox.session
def cells(session: nox.Session) -> None:
    """Every cell of configs/cells.yaml at its configured world size (the plugins' cells need their frameworks);
    JSON in runs/cells.json."""
    _install(session)
    _install_torchtitan(session)
    _install_megatron(session)
    _install_deepspeed(session)
    session.run("scout", "cells", "run", "--all", "--json", "runs/cells.json", *session.posargs,
                env={"OMP_NUM_THREADS": "1"})


@nox.session
def matrix(session: nox.Session) -> None:
    """The fault matrix: every 16-rank cell by layout and fault class (``nox -s matrix -- NAME...``: only those),
    with every framework installed; writes runs/matrix.json, runs/matrix.md (Table 3) and runs/matrix.png."""
    _install(session, "dev,bench")
    _install_torchtitan(session)
    _install_megatron(session)
    _install_deepspeed(session)
    session.run("scout", "cells", "matrix", *session.posargs, "--out", "runs", env={"OMP_NUM_THREADS": "1"})


@nox.session
def demo(session: nox.Session) -> None:
    """Inject faults into 16-rank jobs and show what SCOUT names: verdict table plus incident records."""
    _install(session)
    cells = ("c3-sdc-16", "c3-clean-16", "topology-fig3", "hang-frozen-rank", "hang-mismatch-shape", "data-stall",
             "hang-equal-stall", "ddp-sdc-output", "ddp-compute-straggler", "ddp-recovery-sdc")
    session.run("scout", "cells", "run", *cells, "--json", "runs/demo/cells.json", "--workdir", "runs/demo",
                env={"OMP_NUM_THREADS": "1"})
    for cell in ("topology-fig3", "hang-frozen-rank", "hang-equal-stall", "ddp-sdc-output", "ddp-recovery-sdc"):
        session.log(f"incident records written by {cell}:")
        session.run("scout", "report", f"runs/demo/{cell}/incidents.jsonl")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks as ratios within one run; writes benchmarks/results.json (and the replay curve's PNG)."""
    _install(session, "dev,bench")
    # The shape catalog's tests first: its benchmark section reports what the tested compression selects.
    session.run("python", "-m", "pytest", "-q", "tests/test_moe_catalog.py")
    session.run("python", "benchmarks/run.py", "--out", "benchmarks/results.json", *session.posargs)


@nox.session
def campaign(session: nox.Session) -> None:
    """>= 300 SDC injections across DDP, FSDP2 and HSDP; results in benchmarks/campaign.json and the README."""
    _install(session)
    session.run("python", "-m", "integrations_tests.campaign", "--out", "benchmarks/campaign.json",
                "--readme", "README.md", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff", env=CONSTRAINTS)
    session.run("ruff", "check", "scout_core", "tests", "integrations_tests", "benchmarks", "plugins", "noxfile.py")
