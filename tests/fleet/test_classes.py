"""DeviceClass: the one place a device class name is assembled and read back."""

from __future__ import annotations

import pytest

from pipeline.errors import PipelineError
from pipeline.fleet.classes import DeviceClass, host_class
from pipeline.fleet.probe import Facts

NAMES = [
    # As earlier runs wrote them (engines/<class>/, build.json, manifests, results): they must keep reading the same.
    ("orin-sm87-trt10.3.0", DeviceClass("orin", "sm87", "10.3.0")),
    ("thor-sm110-trt11.0.0", DeviceClass("thor", "sm110", "11.0.0")),
    ("local-sm87-trt10.3.0", DeviceClass("local", "sm87", "10.3.0")),
    ("orin-nx-sm87-trt10.3.1", DeviceClass("orin-nx", "sm87", "10.3.1")),  # a declared name in the same format
    ("orin-sm87-trt10", DeviceClass("orin", "sm87", "10")),
    ("local", DeviceClass("local")),
    ("orin-sm87-trt?", DeviceClass("orin", "sm87", "")),  # a device without a TensorRT package
    ("unknown-sm?-trt?", DeviceClass("unknown")),
]


@pytest.mark.parametrize(("name", "klass"), NAMES)
def test_a_name_and_its_class_round_trip(name: str, klass: DeviceClass):
    assert str(klass) == name
    assert DeviceClass.parse(name) == klass
    assert DeviceClass.parse(str(klass)) == klass


@pytest.mark.parametrize(
    "text", ["", "orin", "sm87-trt10.3.0", "orin-sm87", "orin-87-trt10.3.0", "orin-sm87-trt", "orin-sm87-trt10.", "a"]
)
def test_a_malformed_name_is_refused_with_the_text(text: str):
    with pytest.raises(PipelineError, match="is not a device class name") as err:
        DeviceClass.parse(text)
    assert repr(text) in str(err.value) and "\n" not in str(err.value)


def test_this_host_is_local_until_both_gpu_and_tensorrt_are_known():
    assert str(DeviceClass.this_host("sm87", "10.3.0")) == "local-sm87-trt10.3.0"
    assert DeviceClass.this_host("sm87", None) == DeviceClass.this_host(None, "10.3.0") == DeviceClass("local")
    assert str(DeviceClass.this_host("", "")) == "local"


def test_a_probed_device_is_named_by_its_soc_and_tensorrt():
    assert DeviceClass.probed(Facts(soc="nvidia,tegra234", tensorrt="10.3.0")) == DeviceClass("orin", "sm87", "10.3.0")
    assert str(DeviceClass.probed(Facts(soc="nvidia,tegra194"))) == "xavier-sm72-trt?"
    assert str(DeviceClass.probed(Facts(soc="nvidia,tegra999", tensorrt="10.3.0"))) == "unknown-sm?-trt10.3.0"


def test_host_class_tells_this_hosts_classes_from_any_other_name():
    assert host_class("local-sm87-trt10.3.0") == DeviceClass("local", "sm87", "10.3.0")
    assert host_class("local") == DeviceClass("local")
    for other in ("orin-sm87-trt10.3.0", "localhost", "local-gpu", "a"):
        assert host_class(other) is None
