"""The deployments as people run them: a real local Prefect server, a process worker, `prefect deployment run`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
# The server, worker and deployments come from the `prefect_env` fixture in conftest.py.


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
