"""The run registry: champion lookup, unchanged-data detection and the promotion gate."""

import json
import logging
import os
from pathlib import Path

from pipeline.config import load_config
from pipeline.manifest import StageResult, create_run_dir
from pipeline.registry import champion, list_runs, promotion_gate, record_rollback, trained_with


def _fake_run(root: Path, run_id: str, accuracy: float, deployed: bool, data: str = "d1", release: str = "rel") -> Path:
    cfg = load_config()
    run = create_run_dir(cfg, root / run_id)
    train = StageResult("train", "done", metrics={"val_accuracy": accuracy})
    run.record(train, {"config_digest": "c1", "inputs": {"data": data}})
    deploy = StageResult("deploy", "done" if deployed else "skipped", metrics={"release": release})
    run.record(deploy, {})
    return run.path


def test_champion_is_the_newest_deployed_run(tmp_path: Path):
    _fake_run(tmp_path, "20260101-000000-aaaa", 0.90, deployed=True)
    _fake_run(tmp_path, "20260102-000000-bbbb", 0.95, deployed=True)
    _fake_run(tmp_path, "20260103-000000-cccc", 0.99, deployed=False)
    assert [r.run_id for r in list_runs(tmp_path)] == [
        "20260103-000000-cccc",
        "20260102-000000-bbbb",
        "20260101-000000-aaaa",
    ]
    best = champion(tmp_path)
    assert best is not None and best.run_id == "20260102-000000-bbbb" and best.val_accuracy == 0.95
    # A run re-checking itself is not its own champion, however its path is spelled.
    relative = Path(os.path.relpath(tmp_path / "20260102-000000-bbbb"))
    assert champion(tmp_path, exclude=relative).run_id == "20260101-000000-aaaa"


def test_corrupt_manifest_is_skipped(tmp_path: Path):
    _fake_run(tmp_path, "20260101-000000-aaaa", 0.90, deployed=True)
    (tmp_path / "20260105-000000-zzzz").mkdir()
    (tmp_path / "20260105-000000-zzzz/manifest.json").write_text("{not json")
    assert [r.run_id for r in list_runs(tmp_path)] == ["20260101-000000-aaaa"]


def test_gate_both_branches_and_the_first_model(tmp_path: Path):
    first = promotion_gate(0.5, tmp_path, tolerance=0.01)
    assert first.passed and first.champion is None and "no deployed model" in first.reason
    _fake_run(tmp_path, "20260101-000000-aaaa", 0.96, deployed=True)
    worse = promotion_gate(0.94, tmp_path, tolerance=0.01)
    assert not worse.passed and worse.champion == 0.96 and "not promoted" in worse.reason
    close = promotion_gate(0.955, tmp_path, tolerance=0.01)
    assert close.passed and close.champion_run == "20260101-000000-aaaa"


def test_trained_with_matches_config_and_data(tmp_path: Path):
    _fake_run(tmp_path, "20260101-000000-aaaa", 0.9, deployed=False, data="d1")
    assert trained_with(tmp_path, "c1", {"data": "d1"}) is not None
    assert trained_with(tmp_path, "c1", {"data": "d2"}) is None
    assert trained_with(tmp_path, "c1", {"data": "d1", "weights": "w"}) is None
    assert trained_with(tmp_path, "c2", {"data": "d1"}) is None


def test_a_malformed_manifest_is_skipped_with_a_warning_not_fatal(tmp_path: Path, caplog):
    """A manifest that is valid JSON but not an object, or holds val_accuracy as a string, skips that run only:
    listing, the champion and the gate keep working on the others."""
    _fake_run(tmp_path, "20260101-000000-aaaa", 0.90, deployed=True)
    (tmp_path / "20260102-000000-list").mkdir()
    (tmp_path / "20260102-000000-list" / "manifest.json").write_text("[]")
    text = _fake_run(tmp_path, "20260103-000000-text", 0.95, deployed=True)
    manifest = json.loads((text / "manifest.json").read_text())
    manifest["stages"]["train"]["metrics"]["val_accuracy"] = "0.95"
    (text / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "20260104-000000-junk").mkdir()
    (tmp_path / "20260104-000000-junk" / "manifest.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="pipeline.registry"):
        assert [r.run_id for r in list_runs(tmp_path)] == ["20260101-000000-aaaa"]
        assert champion(tmp_path).run_id == "20260101-000000-aaaa"
        assert promotion_gate(0.5, tmp_path, 0.01).passed is False
    skipped = " ".join(caplog.messages)
    assert "20260102-000000-list" in skipped and "not a JSON object" in skipped
    assert "20260103-000000-text" in skipped and "'0.95', not a number" in skipped
    assert "20260104-000000-junk" in skipped and "corrupt JSON" in skipped


def test_a_rollback_hands_the_championship_back(tmp_path: Path):
    """After `pipeline deploy rollback` the fleet runs the older release again: its run is the champion again, and
    the run rolled back from no longer counts as deployed (a second rollback swaps back)."""
    old = _fake_run(tmp_path, "20260101-000000-aaaa", 0.90, deployed=True, release="rel-a")
    new = _fake_run(tmp_path, "20260102-000000-bbbb", 0.95, deployed=True, release="rel-b")
    assert champion(tmp_path).path == new
    rolled = {"target": "orin-01", "status": "ROLLED_BACK", "current": "rel-a", "previous": "rel-b"}
    record_rollback(tmp_path, [rolled, {"target": "orin-02", "status": "FAILED", "current": "x", "previous": "y"}])
    assert champion(tmp_path).path == old
    assert promotion_gate(0.91, tmp_path, 0.0).champion_run == old.name
    record_rollback(tmp_path, [{**rolled, "current": "rel-b", "previous": "rel-a"}])
    assert champion(tmp_path).path == new
