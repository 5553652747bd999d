"""`pipeline cluster check --deep`: what a device does when asked to train and to serve, before it is trusted with
either. For each device the plain check found ready, over its SSH connection:

- the backend the job would use (every device's agreement: pipeline.train.cluster.choose_backend), initialised with
  one peer on the device and one all-reduce, and one training step of the configured model on the device's own
  accelerator at the configured precision (pipeline.train.rank.selftest);
- one inference of the release installed under `<root>/current`, through TensorRT where the device has it, else ONNX
  Runtime, checked against the release's stored outputs (pipeline.deploy.health, the deploy stage's health check).

Each part is timed on the device. A part that fails is the row's reason and the command's exit 2; a device with no
release yet says so and is not a failure.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import tempfile
from pathlib import Path
from typing import Any

from pipeline import layout
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.files import write_json
from pipeline.fleet.ssh import FAILURES, Device, Refused
from pipeline.train.cluster import NodeCheck, choose_backend, python_path

SELFTEST_TIMEOUT_S = 600
"""Seconds each device's self-test may take (a big model's first step on a small board)."""


def deep(cfg: Config, nodes: list[NodeCheck], code_id: str) -> list[dict[str, Any]]:
    """The self-test row of each ready device (the others are left to the plain check's rows)."""
    ready = [n for n in nodes if n.status == "ready"]
    backend = choose_backend(ready, cfg.train.backend)
    ranks = sum(n.target.nproc_per_node for n in ready)
    with tempfile.TemporaryDirectory(prefix="selftest-") as tmp:
        config = Path(tmp) / layout.CONFIG_SNAPSHOT
        write_json(config, cfg.model_dump(mode="json"))
        work = (_one(n, cfg, code_id, config, backend, ranks) for n in ready)
        return list(asyncio.run(_gather(work)))


async def _gather(work: Any) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*work))


async def _one(node: NodeCheck, cfg: Config, code_id: str, config: Path, backend: str, ranks: int) -> dict[str, Any]:
    target = node.target
    row: dict[str, Any] = {"target": target.name, "backend": backend}
    try:
        async with Device(target, command_timeout_s=SELFTEST_TIMEOUT_S) as dev:
            where = f"{target.root}/train/selftest"
            await dev.run(f"mkdir -p {shlex.quote(where)}", timeout_s=30)
            await dev.put(config, f"{where}/{layout.CONFIG_SNAPSHOT}")
            env = f"PYTHONPATH={shlex.quote(python_path(target, code_id))}"
            args = f"--run-dir {shlex.quote(where)} --backend {backend} --ranks {ranks}"
            out = await dev.run(f"{env} {target.python} -m pipeline.train.rank.selftest {args}", SELFTEST_TIMEOUT_S)
            row |= _training(_json_line(out.stdout, "SELFTEST ") or {"error": out.tail()})
            row |= await _inference(dev, env, target.python, f"{target.root}/{layout.CURRENT}", cfg)
    except (Refused, *FAILURES) as err:
        row["reason"] = f"{type(err).__name__}: {err}".rstrip(": ")
    row["status"] = "failed" if row.get("reason") else "passed"
    return row


def _training(report: dict[str, Any]) -> dict[str, Any]:
    if "error" in report:
        return {"reason": f"self-test: {report['error']}"}
    collective, step = report["backend"], report["train_step"]
    row: dict[str, Any] = {"all_reduce_ms": _ms(collective), "train_step_ms": _ms(step)}
    row |= {"device": step.get("device") or collective.get("device"), "precision": step.get("precision")}
    row["peak_bytes"] = step.get("peak_bytes")  # of the step, on a GPU
    parts = (("all-reduce", collective), ("train step", step))
    failed = [f"{name}: {part.get('reason')}" for name, part in parts if not part.get("ok")]
    if collective.get("skipped"):
        row["all_reduce_ms"] = collective["skipped"]
    return row | ({"reason": "; ".join(failed)} if failed else {})


async def _inference(dev: Device, env: str, python: str, current: str, cfg: Config) -> dict[str, Any]:
    if not (await dev.run(f"test -d {shlex.quote(current)}", timeout_s=30)).ok:
        return {"inference": "no release"}
    deploy = cfg.deploy
    args = f"--atol {deploy.health_atol} --atol-fp16 {deploy.health_atol_fp16} {shlex.quote(current)}"
    out = await dev.run(f"{env} {python} -m pipeline.deploy.health {args}", SELFTEST_TIMEOUT_S)
    verdict = _json_line(out.stdout, "HEALTH ")
    if verdict is None:
        return {"inference": "failed", "reason": f"release: {out.tail()}"}
    if not verdict.get("passed"):
        return {"inference": verdict.get("runtime"), "reason": f"release: {verdict.get('reason')}"}
    return {"inference": verdict["runtime"], "inference_ms": _ms(verdict)}


def _json_line(stdout: str, prefix: str) -> dict[str, Any] | None:
    lines = [line.removeprefix(prefix) for line in stdout.splitlines() if line.startswith(prefix)]
    try:
        found = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _ms(part: dict[str, Any]) -> float | None:
    return round(part["seconds"] * 1000, 1) if isinstance(part.get("seconds"), int | float) else None


def refuse_failed(rows: list[dict[str, Any]]) -> None:
    """One line naming the first device whose self-test failed, and why (exit 2)."""
    for row in rows:
        if row["status"] != "passed":
            raise PipelineError(f"{row['target']}: self-test failed: {row['reason']}")
