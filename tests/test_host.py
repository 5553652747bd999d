"""Host facts from nvidia-smi, against a stand-in `nvidia-smi` (the real one needs an NVIDIA driver)."""

from pathlib import Path

import pytest

from pipeline import host
from pipeline.train.rank import thermal

STANDIN = """#!/bin/sh
# Stand-in for nvidia-smi: two GPUs, answers the two queries the pipeline makes.
case "$1" in
  --query-gpu=compute_cap) printf '8.7\\n8.7\\n' ;;
  --query-gpu=temperature.gpu) printf '61\\n67\\n' ;;
  *) exit 6 ;;
esac
"""


@pytest.fixture
def standin_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = tmp_path / "nvidia-smi"
    exe.write_text(STANDIN)
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


def test_readings_from_nvidia_smi(standin_nvidia_smi: None):
    assert host.nvidia_smi("compute_cap") == ["8.7", "8.7"]
    assert host.nvidia_smi("power.draw") == []  # a failing query is "no reading", not an error
    assert host.nvidia_smi_sm() == "sm87"
    assert thermal._nvidia_smi() == 67.0  # the hottest GPU


def test_no_nvidia_smi_means_no_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert host.nvidia_smi("compute_cap") == []
    assert host.nvidia_smi_sm() is None and thermal._nvidia_smi() is None
