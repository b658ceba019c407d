"""The per-test timeout fires: a test that hangs (sleeping, blocked in a socket recv, waiting on a
child process) fails with pytest-timeout's "Timeout" message, its `finally` blocks run (so a
subprocess-based e2e test still kills what it started), and the run goes on to the next test.

The cases run in one pytest subprocess on a generated test file, with this project's pytest
settings (those of pyproject.toml's `[tool.pytest.ini_options]` that matter here, copied, with the
default timeout lowered to 2 s) and the slow-tier hook of tests/conftest.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import SLOW_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(90)

HANGING_TESTS = '''
import os, signal, socket, subprocess, sys, time

import pytest

CHILD_PID_FILE = {pid_file!r}


def test_sleeps_forever():
    time.sleep(3600)


def test_blocks_on_a_socket_recv():
    a, b = socket.socketpair()
    a.recv(1)


def test_waits_on_a_child_that_never_ends():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    with open(CHILD_PID_FILE, "w") as f:
        f.write(str(child.pid))
    try:
        child.wait()
    finally:  # what Stack.close / Cluster.close do: the timeout must let this run
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def test_after_the_hangs_still_runs():
    pass


@pytest.mark.slow
def test_slow_default(request):
    print("slow timeout", request.node.get_closest_marker("timeout").args)
'''


def project_ini(config: pytest.Config, tmp_path: Path, **overrides) -> Path:
    """This run's pytest settings (pyproject.toml's), as an ini file for a run outside the repository."""
    settings = {"markers": config.getini("markers"), "addopts": " ".join(config.getini("addopts")),
                "timeout": config.getini("timeout"), "timeout_method": config.getini("timeout_method")}
    assert settings["timeout_method"] == "signal" and 0 < float(settings["timeout"]) <= 120, settings
    settings.update(overrides)
    lines = ["[pytest]"]
    for key, value in settings.items():
        if isinstance(value, list):
            lines.append(f"{key} =\n" + "\n".join(f"    {v}" for v in value))
        else:
            lines.append(f"{key} = {value}")
    ini = tmp_path / "pytest.ini"
    ini.write_text("\n".join(lines) + "\n")
    return ini


def test_a_hanging_test_fails_with_timeout_and_the_run_goes_on(tmp_path, pytestconfig):
    pid_file = tmp_path / "child.pid"
    test_file = tmp_path / "test_hangs.py"
    test_file.write_text(textwrap.dedent(HANGING_TESTS.format(pid_file=str(pid_file))))
    # The project's conftest adds the slow-tier default; copy it beside the generated file.
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", str(project_ini(pytestconfig, tmp_path, timeout=2)),
           "--rootdir", str(tmp_path), "-rA", "-s", str(test_file)]
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    elapsed = time.monotonic() - start
    out = result.stdout + result.stderr
    assert elapsed < 30, f"the run took {elapsed:.0f} s:\n{out}"
    assert result.returncode == 1, out
    for name in ("test_sleeps_forever", "test_blocks_on_a_socket_recv", "test_waits_on_a_child_that_never_ends"):
        assert f"FAILED {test_file.name}::{name} - Failed: Timeout" in out, out
    assert f"PASSED {test_file.name}::test_after_the_hangs_still_runs" in out, out
    # The child the third test started was killed by its finally block.
    child_pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)
    # A slow test without a timeout of its own gets the slow tier's, not the (2 s) default.
    assert f"slow timeout ({SLOW_TIMEOUT_S},)" in out, out
