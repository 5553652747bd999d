"""Config loading: TOML, --set overrides, and one-line errors naming the dotted key."""

from pathlib import Path

import pytest

from pipeline.config import DEFAULT_CONFIG, Config, load_config
from pipeline.errors import PipelineError


def test_quickstart_is_the_default_and_matches_the_model_defaults():
    cfg = load_config()
    assert cfg.data.source == "digits"
    assert cfg.model.name == "small_cnn"
    assert [t.name for t in cfg.deploy.targets] == ["local"]
    assert load_config(DEFAULT_CONFIG) == cfg


def test_set_overrides_are_read_as_toml_values():
    cfg = load_config(None, ["train.epochs=3", "export.atol=1e-3", "run.name=nightly", "data.image_size = 24"])
    assert (cfg.train.epochs, cfg.export.atol, cfg.run.name, cfg.data.image_size) == (3, 1e-3, "nightly", 24)


def test_set_can_replace_a_list_of_tables():
    cfg = load_config(None, ['deploy.targets=[{name="a", root="/tmp/a"}, {name="b", root="/tmp/b"}]'])
    assert [t.name for t in cfg.deploy.targets] == ["a", "b"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["train.epoch=3"], "train.epoch: unknown key"),
        (["nosuch.key=1"], "nosuch: unknown key"),
        (["train.epochs=zero"], "train.epochs: Input should be a valid integer"),
        (["train.epochs=0"], "train.epochs: Input should be greater than or equal to 1"),
        (["data.source=imagefolder"], "data: Value error, data.path is required"),
        (["export.opt_batch=64"], "export: Value error, export.opt_batch must not exceed export.max_batch"),
        (['deploy.targets=[{name="a", root="x"}, {name="a", root="y"}]'], "duplicate target name(s): a"),
        (["train"], "--set 'train': expected section.key=value"),
        (["train.batch_size=1000000000000"], "train.batch_size: Input should be less than or equal to 1048576"),
        # Names go into shell scripts on devices (#34: `id > FILE` ran there): only variable names are names.
        (['train.env={"A;id>/tmp/x;B" = "1"}'], "train.env.A;id>/tmp/x;B.[key]: String should match pattern"),
        (['train.pass_env=["$(id)"]'], "train.pass_env.0: String should match pattern"),
        # A secret's value would be written into config.json and the manifest.
        (['train.env={HF_TOKEN = "hf_x"}'], "train.env.HF_TOKEN: looks like a secret"),
        (['train.env={aws_secret_access_key = "x"}'], "list aws_secret_access_key in train.pass_env instead"),
        # Federated training needs devices, each with its own images.
        (["train.mode=federated"], 'train.mode = "federated" needs train.inventory'),
        (["train.mode=federated", "train.inventory=inv.toml"], 'needs data.source = "imagefolder"'),
        (["train.federated.strategy=fedsgd"], "train.federated.strategy: Input should be 'fedavg' or 'fedprox'"),
    ],
)
def test_bad_values_name_the_dotted_key(overrides, expected):
    with pytest.raises(PipelineError) as err:
        load_config(None, overrides)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


RENAMED_NNODES = "train.nnodes: renamed to train.devices"


def test_renamed_key_is_refused_with_its_new_name(tmp_path: Path):
    """`train.nnodes` (the SSH job's device count) became `train.devices`: the CLI's `--nnodes` is torchrun's."""
    toml = tmp_path / "c.toml"
    toml.write_text('[train]\nnnodes = "2:3"\n')
    for load in (lambda: load_config(None, ["train.nnodes=2"]), lambda: load_config(toml)):
        with pytest.raises(PipelineError) as err:
            load()
        assert RENAMED_NNODES in str(err.value) and "--nnodes" in str(err.value)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", ['"2"', '"2:3"', '"1:1"'])
def test_devices_takes_n_or_min_max(value: str):
    assert load_config(None, [f"train.devices={value}"]).train.devices == value.strip('"')
    assert load_config().train.devices is None


@pytest.mark.parametrize("value", ['"0"', '"0:2"', '"2:"', '":3"', '"a"', '"2-3"', '"2:3:4"'])
def test_devices_refuses_what_is_not_n_or_min_max(value: str):
    with pytest.raises(PipelineError, match=r"train\.devices: String should match pattern") as err:
        load_config(None, [f"train.devices={value}"])
    assert "\n" not in str(err.value)


def test_an_older_snapshot_opens_with_the_renamed_key(tmp_path: Path):
    """A run directory's config.json written before the rename (`train.nnodes`) still opens, as `train.devices`;
    only a user's TOML or `--set` is refused."""
    from pipeline.files import read_json, write_json
    from pipeline.layout import CONFIG_SNAPSHOT
    from pipeline.manifest import create_run_dir
    from pipeline.stages import open_run

    run = create_run_dir(load_config(None, ['train.devices="2:3"']), tmp_path / "run")
    snapshot = read_json(run.path / CONFIG_SNAPSHOT)
    snapshot["train"]["nnodes"] = snapshot["train"].pop("devices")
    write_json(run.path / CONFIG_SNAPSHOT, snapshot)
    assert run.load_config().train.devices == "2:3"
    assert open_run(None, run.path)[0].train.devices == "2:3"
    assert open_run(None, run.path, ["train.epochs=2"])[0].train.devices == "2:3"
    with pytest.raises(PipelineError, match=RENAMED_NNODES):
        open_run(None, run.path, ["train.nnodes=2"])


def test_malformed_and_missing_files_are_one_line_errors(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nepochs = 3\n")
    with pytest.raises(PipelineError, match=r"bad\.toml: invalid TOML"):
        load_config(bad)
    with pytest.raises(PipelineError, match=r"missing\.toml: config file not found"):
        load_config(tmp_path / "missing.toml")


def test_digest_depends_only_on_the_named_sections():
    a, b = Config(), load_config(None, ["deploy.keep_releases=7"])
    assert a.digest("train", "data") == b.digest("train", "data")
    assert a.digest("deploy") != b.digest("deploy")


def test_every_field_is_documented():
    undocumented = [
        f"{section}.{name}"
        for section, info in Config.model_fields.items()
        for name, field in info.annotation.model_fields.items()
        if not field.description
    ]
    assert undocumented == []


def test_pass_env_takes_values_from_the_environment_and_names_one_that_is_unset(monkeypatch: pytest.MonkeyPatch):
    cfg = load_config(None, ['train.pass_env=["PIPELINE_T1", "PIPELINE_T2"]'])
    monkeypatch.setenv("PIPELINE_T1", "val-7f3a")
    monkeypatch.delenv("PIPELINE_T2", raising=False)
    with pytest.raises(PipelineError, match=r"^train\.pass_env: PIPELINE_T2 is not set in this environment$"):
        cfg.train.passed_env()
    monkeypatch.setenv("PIPELINE_T2", "two")
    assert cfg.train.passed_env() == {"PIPELINE_T1": "val-7f3a", "PIPELINE_T2": "two"}
    assert "val-7f3a" not in cfg.model_dump_json()  # only the names are config
