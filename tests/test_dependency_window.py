"""The dependency window, tested at both ends: a fresh environment with every direct dependency at its floor, and one
at the newest releases the bounds allow, each passing a subset of the fast tier (tests/dependency_window.py, which
also runs by hand). Needs PyPI; each end takes minutes to install and to test."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("dependency_window.py")


def pypi_reachable() -> bool:
    try:
        socket.getaddrinfo("pypi.org", 443)
    except OSError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not pypi_reachable(), reason="needs PyPI (uv resolves the window's ends from it)")
@pytest.mark.parametrize("end", ["lowest", "newest"])
def test_the_subset_passes_at_each_end_of_the_window(end, tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    from dependency_window import direct_dependencies, floors, release

    result = subprocess.run([sys.executable, str(SCRIPT), end, "--dir", str(tmp_path)], capture_output=True,
                            text=True, timeout=5400)
    (tmp_path / "dependency_window.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    print(f"{end}: {summary['tests']} in {summary['tests_s']} s; "
          + " ".join(f"{name}=={version}" for name, version in summary["versions"].items()))
    assert summary["tests"]["passed"] > 100 and summary["tests"]["failed"] == summary["tests"]["errors"] == 0
    assert summary["joblib_sweep"]
    dependencies = direct_dependencies()
    assert set(summary["versions"]) == set(dependencies) and "missing" not in summary["versions"].values()
    if end == "lowest":
        at = {name: release(summary["versions"][name]) for name in floors(dependencies) if name != "torch"}
        assert at == {name: release(floor) for name, floor in floors(dependencies).items() if name != "torch"}
    assert (tmp_path / "versions.txt").read_text().count("==") == len(dependencies)
