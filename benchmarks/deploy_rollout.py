"""How does an SSH rollout of a 50 MB release scale from 1 to 4 to 12 devices, and what does an unchanged redeploy
send?

Devices are stand-in Jetsons (tests/harness: a real sshd per device in its own namespaces). By default each has its
own network namespace and a link shaped to `--rate` (tbf, both directions), standing in for one WiFi/Ethernet
link per board; `--rate none` uses plain loopback (then the two CPU cores, not the links, are the bottleneck).
Baseline: the rollout to 1 device. Policy: no canary, one wave, max_parallel = device count, so the numbers are the
transport's, not the rollout policy's. Needs root and openssh-server (see tests/harness).

    python benchmarks/deploy_rollout.py [--rate 40mbit] [--repeats 2]

Writes benchmarks/results/deploy_rollout.json (deploy_rollout_loopback.json with `--rate none`) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.config import Config  # noqa: E402
from pipeline.deploy.rollout import rollout  # noqa: E402
from pipeline.deploy.stage import fleet_releases  # noqa: E402
from pipeline.fleet.inventory import load_inventory  # noqa: E402
from pipeline.manifest import RunDir, StageResult, create_run_dir  # noqa: E402
from tests.harness import JetsonFleet, TargetSpec, harness_unavailable, make_plan  # noqa: E402

RESULTS = REPO / "benchmarks/results/deploy_rollout.json"
ENGINE_BYTES = 48_000_000
ONNX_BYTES = 2_000_000
COUNTS = (1, 4, 12)
CLASS = "orin-sm87-trt10.3.0"


def make_run(root: Path) -> RunDir:
    """A run directory whose release is ~50 MB: a 2 MB model file and a 48 MB stand-in Orin engine."""
    run = create_run_dir(Config(), root / "run")
    (run.path / "onnx").mkdir()
    (run.path / "model").mkdir()
    rng = np.random.default_rng(0)
    (run.path / "onnx/model.onnx").write_bytes(rng.bytes(ONNX_BYTES))
    np.savez(run.path / "onnx/sample.npz", input=np.zeros((1, 1, 16, 16), np.float32), logits=np.zeros((1, 10)))
    (run.path / "model/model.json").write_text(json.dumps({"classes": [str(i) for i in range(10)]}))
    engines = run.path / "engines" / CLASS
    engines.mkdir(parents=True)
    # Random padding, not zeros: a real engine does not compress, and SSH could otherwise compress it.
    plan = make_plan("10.3.0.30", {"soc": "nvidia,tegra234"}, 4096) + rng.bytes(ENGINE_BYTES - 4096)
    (engines / "model.plan").write_bytes(plan)
    (engines / "build.json").write_text(json.dumps({"class": CLASS, "precision": "fp16"}))
    outputs = {"engine": f"engines/{CLASS}/model.plan", "build_info": f"engines/{CLASS}/build.json"}
    run.record(StageResult("build", "done", outputs=outputs), {})
    return run


def measure(fleet: JetsonFleet, names: list[str], run: RunDir, path: Path) -> dict[str, Any]:
    """One rollout to `names`: wall seconds, statuses, bytes sent."""
    policy = {"canary": 0, "wave_size": len(names), "max_parallel": len(names)}
    inventory = load_inventory(fleet.write_inventory(path, names=names, policy=policy))
    releases = fleet_releases(run)
    started = time.perf_counter()
    rows = asyncio.run(rollout(inventory, releases, log=lambda _: None))
    seconds = time.perf_counter() - started
    bad = [f"{r.target}: {r.status} {r.reason}" for r in rows if r.status != "ACTIVE"]
    if bad:
        raise SystemExit(f"rollout failed: {bad}")
    return {"seconds": seconds, "bytes_sent": sum(r.bytes_sent for r in rows), "release_bytes": releases.bytes}


def wipe(fleet: JetsonFleet) -> None:
    for target in fleet:
        target.run("rm -rf /opt/edge/* /opt/edge/.lock /opt/edge/.health.log")


def main() -> None:
    """Run the rollouts, write the JSON, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="40mbit", help="tc rate per device link, or 'none' for loopback")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    shaped = args.rate != "none"
    reason = harness_unavailable(network=shaped)
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    specs = [TargetSpec(f"orin-{i:02d}", disk_size="160m", network=shaped) for i in range(1, max(COUNTS) + 1)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, JetsonFleet(Path(tmp) / "fleet", specs) as fleet:
        if shaped:
            for target in fleet:
                assert target.link is not None
                target.link.shape(args.rate)
        run = make_run(Path(tmp))
        for count in COUNTS:
            names = [t.name for t in fleet.targets[:count]]
            samples = []
            for _ in range(args.repeats):
                wipe(fleet)
                samples.append(measure(fleet, names, run, Path(tmp) / f"inv-{count}.toml"))
            rows.append({"case": f"{count} device(s), new release", "devices": count, **_summary(samples)})
        again = [measure(fleet, names, run, Path(tmp) / "inv-again.toml") for _ in range(args.repeats)]
        rows.append({"case": f"{max(COUNTS)} devices, unchanged redeploy", "devices": max(COUNTS), **_summary(again)})
    base = rows[0]["seconds"]
    for row in rows:
        row["ratio_vs_1"] = round(row["seconds"] / base, 2)
    result = {
        "question": "SSH rollout time of a 50 MB release vs device count; bytes an unchanged redeploy sends",
        "link": args.rate if shaped else "loopback (no shaping)",
        "repeats": args.repeats,
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "targets": {
            "12 devices <= 3x the time of 1": rows[2]["ratio_vs_1"] <= 3,
            "unchanged sends 0 bytes": rows[3]["bytes_sent"] == 0,
        },
        "rows": rows,
    }
    out = RESULTS if shaped else RESULTS.with_name("deploy_rollout_loopback.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"link: {result['link']}, median of {args.repeats}")
    print("| case | seconds | vs 1 device | MB sent |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['case']} | {row['seconds']:.2f} | {row['ratio_vs_1']:.2f}x | {row['bytes_sent'] / 1e6:.1f} |")
    print(f"targets met: {result['targets']}")


def _summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "seconds": round(statistics.median(s["seconds"] for s in samples), 3),
        "seconds_all": [round(s["seconds"], 3) for s in samples],
        "bytes_sent": samples[-1]["bytes_sent"],
        "release_bytes": samples[-1]["release_bytes"],
    }


if __name__ == "__main__":
    main()
