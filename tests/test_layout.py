"""The names layout declares: the build stage's per-class manifest keys, as deploy reads them back."""

from __future__ import annotations

import pytest

from pipeline.layout import class_of_engine_key, engine_keys


@pytest.mark.parametrize("klass", ["orin-sm87-trt10.3.0", "local-sm87-trt10.3.0", "local", "orin-nx-sm87-trt10.3.1"])
def test_a_class_comes_back_from_its_engine_key(klass: str):
    engine, info = engine_keys(klass)
    assert (engine, info) == (f"engine:{klass}", f"build_info:{klass}")  # as manifests of earlier runs hold them
    assert class_of_engine_key(engine) == klass


@pytest.mark.parametrize("key", ["engine", "build_info", "build_info:orin-sm87-trt10.3.0", "classes", "xengine:a"])
def test_other_output_keys_name_no_class(key: str):
    assert class_of_engine_key(key) is None
