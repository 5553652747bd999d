"""Property-based tests of every parser a user feeds: any input is a valid object or one PipelineError, never
another exception (the CLI turns only PipelineError into one line and exit 2)."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import Config, apply_overrides, load_config, toml_value, validate
from pipeline.errors import PipelineError
from pipeline.files import read_json
from pipeline.fleet.inventory import Inventory, load_inventory
from pipeline.registry import champion, list_runs, promotion_gate, trained_with
from tests.harness.inventory import write_inventory

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEYS = st.sampled_from(["run", "data", "train", "model", "export", "build", "deploy", "retrain", "epochs", "x"])
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4))
TOMLISH = st.recursive(
    st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
)


def _either(call: Any, kind: type) -> None:
    try:
        assert isinstance(call(), kind)
    except PipelineError as err:
        assert "\n" not in str(err)


@SETTINGS
@given(st.dictionaries(KEYS, JSON, max_size=4))
def test_any_config_table_is_a_config_or_one_line(data: dict[str, Any]) -> None:
    _either(lambda: validate(data, "fuzz"), Config)


@SETTINGS
@given(st.lists(st.text(max_size=40) | st.builds(lambda k, v: f"train.{k}={v}", KEYS, st.text(max_size=15))))
def test_any_set_override_is_a_config_or_one_line(overrides: list[str]) -> None:
    _either(lambda: load_config(None, overrides), Config)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["train.epochs", "data.source", "a.b.c", "x"]), TOMLISH, max_size=3))
def test_any_override_value_merges_or_is_one_line(values: dict[str, Any]) -> None:
    overrides = [f"{key}={toml_value(value)}" for key, value in values.items()]
    _either(lambda: validate(apply_overrides({}, overrides), "fuzz"), Config)


@SETTINGS
@given(st.text(max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("latin-1")))
def test_any_inventory_text_is_an_inventory_or_one_line(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fleet.toml"
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        _either(lambda: load_inventory(path), Inventory)


TARGET_KEYS = st.sampled_from(["name", "host", "port", "user", "key", "root", "service", "health_command", "tags"])


@SETTINGS
@given(
    st.dictionaries(TARGET_KEYS, TOMLISH, max_size=3),
    st.dictionaries(st.sampled_from(["canary", "wave_size", "max_parallel", "timeout_s", "x"]), TOMLISH, max_size=3),
    st.lists(st.dictionaries(TARGET_KEYS, TOMLISH, max_size=5), max_size=3),
)
def test_any_inventory_tables_are_an_inventory_or_one_line(defaults: dict, policy: dict, targets: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_inventory(Path(tmp) / "fleet.toml", defaults, policy, targets)
        _either(lambda: load_inventory(path), Inventory)


@SETTINGS
@given(JSON | st.dictionaries(st.sampled_from(["stages", "run_id", "config"]), JSON, max_size=3))
def test_any_manifest_is_listed_or_skipped(manifest: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "20260101-000000-aaaa"
        run.mkdir()
        (run / "manifest.json").write_text(json.dumps(manifest))
        _either(lambda: read_json(run / "manifest.json"), object)
        assert len(list_runs(Path(tmp))) <= 1
        # The questions scheduled retraining asks of past runs answer, whatever one of them holds.
        champion(Path(tmp))
        trained_with(Path(tmp), "digest", {"data": "d"})
        assert isinstance(promotion_gate(0.5, Path(tmp), 0.01).passed, bool)


DEEP = 5000
"""Levels of nesting far past Python's recursion limit (1000): the parsers recurse once per level or more."""
DEEP_VALUES = {
    "lists": "[" * DEEP + "]" * DEEP,
    "tables": "{a = " * DEEP + "1" + "}" * DEEP,
}


@pytest.mark.parametrize("value", DEEP_VALUES.values(), ids=DEEP_VALUES.keys())
def test_a_deeply_nested_set_value_is_one_line(value: str) -> None:
    with pytest.raises(PipelineError, match=r"^--set train\.lr: lists or tables nested too deeply to read$"):
        load_config(None, [f"train.lr={value}"])


@pytest.mark.parametrize("value", DEEP_VALUES.values(), ids=DEEP_VALUES.keys())
def test_a_deeply_nested_config_or_inventory_file_is_one_line(tmp_path: Path, value: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f"[train]\nlr = {value}\n")
    with pytest.raises(PipelineError, match=rf"^{config}: invalid TOML: lists or tables nested too deeply"):
        load_config(config)
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(f'[[targets]]\nname = "a"\nhost = "h"\ntags = {value}\n')
    with pytest.raises(PipelineError, match=rf"^{fleet}: invalid TOML: lists or tables nested too deeply"):
        load_inventory(fleet)


@pytest.mark.parametrize("value", ["[" * DEEP + "]" * DEEP, '{"a": ' * DEEP + "1" + "}" * DEEP])
def test_a_deeply_nested_manifest_is_skipped_and_the_others_listed(tmp_path: Path, value: str, caplog) -> None:
    good, deep = tmp_path / "20260101-000000-good", tmp_path / "20260102-000000-deep"
    for run in (good, deep):
        run.mkdir()
    (good / "manifest.json").write_text(json.dumps({"run_id": good.name, "stages": {}}))
    (deep / "manifest.json").write_text(f'{{"run_id": "x", "stages": {{}}, "stopped": {value}}}')
    with caplog.at_level(logging.WARNING, logger="pipeline.registry"):
        assert [r.run_id for r in list_runs(tmp_path)] == [good.name]
    assert f"skipping run {deep.name}: {deep / 'manifest.json'}: corrupt JSON: lists or tables nested" in caplog.text
    with pytest.raises(PipelineError, match=r"corrupt JSON: lists or tables nested too deeply to read$"):
        read_json(deep / "manifest.json")
