"""The deployments as people run them: a real local Prefect server, a process worker, `prefect deployment run`."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))


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


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def prefect_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A local server on SQLite and a process worker on the `edge-local` pool, with `prefect deploy --all` done."""
    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }
    server_cmd = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui", "--analytics-off"]
    logs = (tmp_path / "server.log").open("w"), (tmp_path / "worker.log").open("w")
    server = subprocess.Popen(server_cmd, env=env, stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True)
    worker = None
    try:
        _wait_healthy(env["PREFECT_API_URL"], server)
        for cmd in (["work-pool", "create", "edge-local", "--type", "process"], ["--no-prompt", "deploy", "--all"]):
            subprocess.run([PREFECT, *cmd], env=env, cwd=REPO, check=True, capture_output=True, timeout=120)
        worker_cmd = [PREFECT, "worker", "start", "--pool", "edge-local"]
        worker = subprocess.Popen(
            worker_cmd, env=env, cwd=REPO, stdout=logs[1], stderr=subprocess.STDOUT, start_new_session=True
        )
        yield env
    finally:
        for proc in (worker, server):
            if proc is not None:
                _stop(proc)


def _run_nightly(env: dict[str, str], overrides: list[str]) -> subprocess.CompletedProcess[str]:
    params = json.dumps({"overrides": overrides})
    cmd = [
        PREFECT,
        "deployment",
        "run",
        "train-to-deploy/nightly",
        "--params",
        params,
        "--watch",
        "--watch-timeout",
        "420",
    ]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=480)


@pytest.mark.slow
def test_nightly_deployment_completes_and_a_failing_run_exits_1(prefect_env: dict[str, str], tmp_path: Path):
    base = [
        "retrain.only_on_new_data=true",
        "train.epochs=2",
        f"run.runs_root={tmp_path / 'runs'}",
        f'deploy.targets=[{{name="edge", root="{tmp_path / "device"}"}}]',
    ]
    ok = _run_nightly(prefect_env, base)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "Completed" in ok.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "manifest.json").read_text())["stages"]["deploy"]["status"] == "done"
    assert (tmp_path / "device/current").is_symlink()

    failing = _run_nightly(prefect_env, [*base, "data.source=imagefolder", f"data.path={tmp_path / 'missing'}"])
    assert failing.returncode == 1, failing.stdout[-3000:]
    assert "Failed" in failing.stdout
