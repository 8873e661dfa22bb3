"""pyproject.toml's version ranges are the ones tested: each lower bound is pinned in .ci/floor.txt, where the whole
suite passed on it (that file's command re-checks them), and nothing is capped without a reason."""
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for deps in project["optional-dependencies"].values() for r in deps if not r.startswith("plugvlm[")]
    return [Requirement(r) for r in project["dependencies"] + extras]


def _floor_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / ".ci" / "floor.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[_canonical(name)] = Version(version)
    return pins


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_lower_bound_is_the_tested_floor():
    pins = _floor_pins()
    declared = set()
    for req in _requirements():
        name = _canonical(req.name)
        declared.add(name)
        lower = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert len(lower) == 1, f"{req}: one lower bound, the tested floor"
        assert not [s for s in req.specifier if s.operator in ("<", "<=", "==", "~=")], \
            f"{req}: an upper bound needs a release known to break (and a comment saying which)"
        assert name in pins and pins[name] == lower[0], f"{req}: .ci/floor.txt pins {name} {pins.get(name)}"
    assert set(pins) <= declared, f"pinned in .ci/floor.txt but not a dependency: {sorted(set(pins) - declared)}"


def test_python_floor_and_the_floor_command():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floor = (ROOT / ".ci" / "floor.txt").read_text()
    oldest = project["requires-python"].removeprefix(">=")
    assert f"python{oldest} -m venv" in floor  # the floor is checked on the oldest Python allowed
    pins = _floor_pins()
    assert f"torch=={pins['torch']} torchvision=={pins['torchvision']}" in floor  # the command installs the pins
