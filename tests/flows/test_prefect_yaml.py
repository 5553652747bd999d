"""prefect.yaml: the deployments people run, the nightly schedule's next run times (computed offline)."""

import asyncio
import datetime as dt
from pathlib import Path
from zoneinfo import ZoneInfo

import yaml
from prefect.server.schemas.schedules import CronSchedule

from pipeline.stages import STAGES

REPO = Path(__file__).resolve().parents[2]


def _deployments() -> dict[str, dict]:
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    return {d["name"]: d for d in spec["deployments"]}


def test_every_stage_and_the_whole_chain_have_a_deployment():
    deployments = _deployments()
    assert deployments["nightly"]["entrypoint"] == "flows/train_to_deploy.py:train_to_deploy"
    for stage in STAGES:
        assert deployments[stage]["entrypoint"] == "flows/stage.py:pipeline_stage"
        assert deployments[stage]["parameters"]["stage"] == stage
    assert {d["work_pool"]["name"] for d in deployments.values()} == {"edge-local"}


def test_nightly_runs_at_three_in_berlin_with_parameters_on_the_deployment():
    nightly = _deployments()["nightly"]
    (schedule,) = nightly["schedules"]
    # Prefect 3.9.1 drops per-schedule parameters on pause/resume: they must live on the deployment.
    assert "parameters" not in schedule
    assert "retrain.only_on_new_data=true" in nightly["parameters"]["overrides"]
    start = dt.datetime(2026, 3, 27, 12, tzinfo=ZoneInfo("UTC"))  # spans the switch to summer time
    dates = asyncio.run(CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"]).get_dates(n=3, start=start))
    local = [d.astimezone(ZoneInfo("Europe/Berlin")) for d in dates]
    assert [(d.day, d.hour, d.minute) for d in local] == [(28, 3, 0), (29, 3, 0), (30, 3, 0)]
    assert [d.utcoffset() for d in local] == [dt.timedelta(hours=1), dt.timedelta(hours=2), dt.timedelta(hours=2)]


def test_nightly_cluster_retrains_on_the_example_inventory():
    from pipeline.config import load_config, read_toml

    nightly = _deployments()["nightly-cluster"]
    assert nightly["entrypoint"] == "flows/train_to_deploy.py:train_to_deploy"
    cfg = load_config(REPO / nightly["parameters"]["config"])
    assert cfg.train.inventory is not None and cfg.train.devices
    inventory = read_toml(REPO / cfg.train.inventory, "inventory")  # the example's hosts are placeholders
    assert len(inventory["targets"]) >= 2 and inventory["defaults"]["python"] == "/usr/bin/python3"


def test_nightly_federated_trains_the_example_cameras_in_their_idle_windows():
    from pipeline.config import load_config, read_toml

    nightly = _deployments()["nightly-federated"]
    assert nightly["entrypoint"] == "flows/train_to_deploy.py:train_to_deploy"
    cfg = load_config(REPO / nightly["parameters"]["config"])
    assert cfg.train.mode == "federated" and cfg.train.inventory is not None
    assert cfg.data.reference is not None  # export's gates cannot read the cameras' images
    inventory = read_toml(REPO / cfg.train.inventory, "inventory")  # the example's hosts are placeholders
    assert inventory["defaults"]["idle"] and len(inventory["targets"]) >= 2
    assert cfg.deploy.inventory == cfg.train.inventory  # the model goes back to the cameras that trained it
