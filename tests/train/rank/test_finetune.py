"""Starting from a weights file: torchvision-style `.pth` and safetensors, the head replaced for another class
count, freezing, the warm-up schedule; and one real run that fine-tunes with a frozen backbone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import models
from pipeline import layout, modelfile, train
from pipeline.config import validate
from pipeline.errors import PipelineError
from pipeline.files import read_json, write_json
from pipeline.manifest import create_run_dir
from pipeline.train.rank.finetune import frozen_names, scheduled_lr


def saved(model: torch.nn.Module, path: Path) -> Path:
    """`model`'s state dict as torchvision publishes its weights (`torch.save` to .pth) or as safetensors."""
    state = model.state_dict()
    if path.suffix == ".safetensors":
        save_file({k: t.contiguous() for k, t in state.items()}, str(path))
    else:
        torch.save(state, path)
    return path


@pytest.mark.parametrize(
    ("name", "head"),
    [
        ("resnet18", ["fc.weight [1000, 512]", "fc.bias [1000]"]),
        ("mobilenet_v3_small", ["classifier.3.weight [1000, 1024]", "classifier.3.bias [1000]"]),
    ],
)
def test_an_imagenet_head_is_replaced_and_every_other_tensor_loaded(tmp_path: Path, name: str, head: list[str]) -> None:
    torch.manual_seed(1)
    published = saved(models.build_model(name, 1000, 3), tmp_path / f"{name}.pth")
    torch.manual_seed(2)
    model = models.build_model(name, 5, 3)
    fresh_head = {k: t.clone() for k, t in model.state_dict().items() if k.startswith(models.spec_for(name).head)}
    assert models.load_weights(model, name, published) == head
    source = torch.load(published, weights_only=True)
    for key, tensor in model.state_dict().items():
        if key in fresh_head:
            assert torch.equal(tensor, fresh_head[key])  # the new head keeps its initialisation
        else:
            assert torch.equal(tensor, source[key]), key


def test_safetensors_of_the_same_class_count_load_whole(tmp_path: Path) -> None:
    torch.manual_seed(1)
    source = models.build_model("small_cnn", 10, 1)
    path = saved(source, tmp_path / "w.safetensors")
    model = models.build_model("small_cnn", 10, 1)
    assert models.load_weights(model, "small_cnn", path) == []
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values(), strict=True)
    )


def test_weights_of_another_architecture_are_one_line(tmp_path: Path) -> None:
    path = saved(models.build_model("small_cnn", 10, 3), tmp_path / "small.pth")
    with pytest.raises(
        PipelineError, match=r"model\.weights: .*small\.pth does not fit resnet18: missing conv1\.weight"
    ):
        models.load_weights(models.build_model("resnet18", 10, 3), "resnet18", path)


class Payload:
    """Anything but a tensor: what `weights_only=True` exists to refuse."""


def test_a_pth_holding_objects_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "evil.pth"
    torch.save({"conv.weight": Payload()}, path)
    with pytest.raises(PipelineError, match=r"evil\.pth: refused by weights_only loading: .*Unsupported global"):
        models.read_weights(path)
    cut = saved(models.build_model("small_cnn", 10, 1), tmp_path / "cut.pth")
    cut.write_bytes(cut.read_bytes()[:1000])
    with pytest.raises(PipelineError, match=r"cut\.pth: cannot read weights"):
        models.read_weights(cut)


def test_freeze_backbone_is_everything_but_the_head_and_blocks_count_from_the_stem() -> None:
    resnet = models.build_model("resnet18", 5, 3)
    frozen = frozen_names(resnet, "resnet18", "backbone")
    assert {n for n, _ in resnet.named_parameters()} - frozen == {"fc.weight", "fc.bias"}
    assert frozen_names(resnet, "resnet18", 2) == {"conv1.weight", "bn1.weight", "bn1.bias"}
    assert frozen_names(resnet, "resnet18", "none") == set()
    with pytest.raises(PipelineError, match=r"model\.freeze: 11 blocks would freeze all of resnet18's 11"):
        frozen_names(resnet, "resnet18", 11)


def test_the_schedule_warms_up_linearly_then_decays_by_cosine() -> None:
    assert [scheduled_lr(0.1, s, 100, warmup=4) for s in range(4)] == pytest.approx([0.025, 0.05, 0.075, 0.1])
    assert scheduled_lr(0.1, 4, 100, warmup=4) == pytest.approx(0.1)
    assert scheduled_lr(0.1, 52, 100, warmup=4) == pytest.approx(0.05)
    assert scheduled_lr(0.1, 100, 100, warmup=4) == pytest.approx(0.0)
    assert scheduled_lr(0.1, 150, 100) == pytest.approx(0.0)  # a shorter resumed schedule never goes negative


STEPS_PER_EPOCH = 23  # 1437 training digits, 2 ranks of 32


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_fine_tuning_replaces_the_head_and_trains_only_it_while_frozen(tmp_path: Path) -> None:
    """small_cnn weights for 4 classes (a .pth, as torchvision publishes) start a 10-class digits run whose backbone
    is frozen for the first of two epochs."""
    torch.manual_seed(7)
    weights = saved(models.build_model("small_cnn", 4, 1), tmp_path / "four.pth")
    model = {"name": "small_cnn", "weights": str(weights), "freeze": "backbone", "freeze_epochs": 1}
    cfg = validate({"model": model, "train": {"epochs": 2, "nproc_per_node": 2, "keep_checkpoints": 2}}, "test")
    run = create_run_dir(cfg, tmp_path / "run")
    train.run(cfg, run, log=lambda _: None)

    summary = read_json(run.path / layout.SUMMARY)
    assert summary["weights_dropped"] == ["5.weight [4, 64]", "5.bias [4]"]
    assert read_json(run.path / layout.DATASET)["normalization"] == "imagenet"  # auto, with a weights file
    assert run.manifest()["stages"]["train"]["inputs"]["weights"]

    def params(step: int) -> dict[str, torch.Tensor]:
        net = models.build_model("small_cnn", 10, 1)
        state = {"model": net.state_dict()}
        dcp.load(state, checkpoint_id=run.path / layout.CHECKPOINTS / f"step-{step}", no_dist=True)
        return {n: state["model"][n] for n, _ in net.named_parameters()}

    source, first, second = torch.load(weights, weights_only=True), params(STEPS_PER_EPOCH), params(2 * STEPS_PER_EPOCH)
    backbone = [n for n in first if not n.startswith("5.")]
    assert all(torch.equal(first[n], source[n]) for n in backbone)  # frozen through epoch 1
    assert not all(torch.equal(second[n], first[n]) for n in backbone)  # trains in epoch 2
    assert not torch.equal(first["5.bias"], second["5.bias"])


def test_the_statistics_a_weights_file_was_trained_with_come_from_its_metadata_or_its_model_json(
    tmp_path: Path,
) -> None:
    net = models.build_model("small_cnn", 3, 3)
    meta = {"architecture": "small_cnn", "num_classes": 3, "input": {"mean": [0.1, 0.2, 0.3], "std": [0.4, 0.5, 0.6]}}
    modelfile.write_model(tmp_path / "run", net.state_dict(), meta)
    weights = tmp_path / "run" / layout.WEIGHTS_NAME
    (tmp_path / "run" / layout.MODEL_JSON_NAME).unlink()  # copied alone: the file's own tags still say
    assert modelfile.recorded_stats(weights) == ([0.1, 0.2, 0.3], [0.4, 0.5, 0.6])

    (tmp_path / "older").mkdir()
    untagged = saved(net, tmp_path / "older" / "model.safetensors")
    assert modelfile.recorded_stats(untagged) is None  # from elsewhere: ImageNet's
    write_json(tmp_path / "older" / layout.MODEL_JSON_NAME, meta)  # an earlier run's model/ directory
    assert modelfile.recorded_stats(untagged) == ([0.1, 0.2, 0.3], [0.4, 0.5, 0.6])
    write_json(tmp_path / "older" / layout.MODEL_JSON_NAME, {**meta, "input": {"mean": [0.1], "std": [0.0]}})
    assert modelfile.recorded_stats(untagged) is None  # a zero std is no statistics
    assert modelfile.recorded_stats(saved(net, tmp_path / "older" / "published.pth")) is None
