"""The compression benchmark's weak link: what crosses it is delayed and rate-limited, and nothing is left behind."""

from __future__ import annotations

import statistics
import subprocess

import pytest

from benchmarks.weaklink import WeakLink, measure, unavailable

RATE_MBIT, DELAY_MS = 20, 15.0


@pytest.mark.skipif(unavailable() is not None, reason=f"weak link: {unavailable()}")
def test_the_link_adds_its_delay_each_way_and_caps_the_rate_both_ways() -> None:
    with WeakLink(f"{RATE_MBIT}mbit", DELAY_MS) as link:
        namespaces = link.namespaces
        m = measure(link, seconds=1.5)
    assert 2 * DELAY_MS <= statistics.median(m["rtt_ms"]) < 2 * DELAY_MS + 50  # + scheduling on a busy machine
    for mbit in (m["a_to_b_mbit"], m["b_to_a_mbit"]):
        assert 0.3 * RATE_MBIT < mbit <= 1.05 * RATE_MBIT  # the bytes went through tbf, and got through
    assert all("Sent 0 bytes" not in line for line in m["tbf"])
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(ns in left for ns in namespaces)
