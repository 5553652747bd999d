"""A real Prefect API (temporary SQLite server) for the whole test session, and real local servers for the tests
that run Prefect as people do: its CLI, a process worker, the UI."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prefect.testing.utilities import prefect_test_harness

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))


@pytest.fixture(scope="session", autouse=True)
def prefect_api():
    with prefect_test_harness(server_startup_timeout=60):
        yield


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "prefect server exited"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"prefect server at {url} not healthy after {timeout_s}s")


def stop(proc: subprocess.Popen) -> None:
    """End a process started with start_new_session=True, and everything it started (TERM, then KILL)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def local_server(tmp_path: Path, *, ui: bool, services: bool = True) -> Iterator[dict[str, str]]:
    """`prefect server start` on 127.0.0.1, SQLite under tmp_path; yields the environment that talks to it.

    With `ui`, the server also serves the UI from the prefect wheel, told (PREFECT_UI_API_URL) where its API is.
    Without `services` (scheduler, late runs, ...) it starts in about two thirds of the time; only the API and UI run.
    """
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_URL": f"{url}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }
    if ui:
        env |= {"PREFECT_UI_URL": url, "PREFECT_UI_API_URL": f"{url}/api"}
    cmd = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--analytics-off"]
    cmd += ([] if ui else ["--no-ui"]) + ([] if services else ["--no-services"])
    with (tmp_path / "server.log").open("w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(env["PREFECT_API_URL"], server)
        yield env
    finally:
        stop(server)


@pytest.fixture
def prefect_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A local server on SQLite and a process worker on the `edge-local` pool, with `prefect deploy --all` done."""
    with local_server(tmp_path, ui=False) as env:
        for cmd in (["work-pool", "create", "edge-local", "--type", "process"], ["--no-prompt", "deploy", "--all"]):
            subprocess.run([PREFECT, *cmd], env=env, cwd=REPO, check=True, capture_output=True, timeout=120)
        with (tmp_path / "worker.log").open("w") as log:
            worker = subprocess.Popen(
                [PREFECT, "worker", "start", "--pool", "edge-local"],
                env=env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            yield env
        finally:
            stop(worker)


@pytest.fixture
def prefect_ui(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A local server with its UI (the environment's PREFECT_UI_URL is where a browser opens it).

    No services: flows run in the test's own processes, not from schedules or a work pool.
    """
    with local_server(tmp_path, ui=True, services=False) as env:
        yield env
