"""One SSH training job, driven from the controller's run directory: rounds of torchrun agents on a fixed set of
devices, each new checkpoint copied back as it is committed, and the membership between rounds (devices that left,
devices that came back). See :mod:`pipeline.train.cluster` for the design; :mod:`pipeline.train.cluster.rounds` runs
a job.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline import layout
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.files import first_line, fsync_dir
from pipeline.fleet import upload
from pipeline.fleet.ssh import FAILURES
from pipeline.safe_dcp import read_metadata
from pipeline.train.cluster import NodeCheck, bounds, check_one, lacks_nccl, nodedata, python_path, run_key
from pipeline.train.cluster.agent import Printer, agent_script, env_file, torchrun_command
from pipeline.train.cluster.node import Node
from pipeline.train.rank import checkpoint
from pipeline.train.rank.runtime import BACKEND_ENV, DATA_LOCAL_ENV, DATA_PATH_ENV
from pipeline.train.rank.store import RANKS_STORE_ENV

POLL_S = 2.0
"""Seconds between the controller's looks at the devices: a new checkpoint to copy, the last step, a device back."""
COPY_SHARE = 0.1
"""While a round runs, the most of the time the controller's copies of new checkpoints may take: every device saves
after each outer step in a cluster job (pipeline/train/rank/checkpoint.py), and a model's checkpoint (weights,
optimizer, outer state) can outweigh an outer step's traffic on a weak link. The devices hold their own; the round's
end, and a device coming back, copy the newest at once."""
REJOIN_EVERY_S = 10.0
"""Seconds between attempts to reach a device that left."""
TCP_RTO_MAX_S = 120
"""Linux's TCP_RTO_MAX: once a link is back from a blackout, the longest its connections wait to send again."""
PREPARE_FAILURES = (*FAILURES, upload.UploadFailed, PipelineError)
"""What preparing a device's run directory fails with when the device cannot take it: a transfer or a command that
failed there (no space left, the link lost), an upload that would not verify."""


@dataclass
class Event:
    """A device that left or joined: when, the last step trained before, and the step training went on from."""

    event: str
    node: str
    time: float
    at_step: int
    resumed_step: int

    @property
    def steps_lost(self) -> int:
        """Steps trained after the checkpoint training went on from: done again."""
        return max(self.at_step - self.resumed_step, 0)

    def record(self) -> dict[str, Any]:
        """As written to summary.json and metrics.jsonl."""
        return {**asdict(self), "steps_lost": self.steps_lost}


@dataclass
class RoundEnd:
    """How a round ended: finished, or with the devices that left, or to take in devices that came back."""

    finished: bool = False
    lost: list[Node] = field(default_factory=list)
    joining: list[NodeCheck] = field(default_factory=list)


class Job:
    """One cluster training job, driven from the controller's run directory."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        nodes: list[NodeCheck],
        code: upload.Bundle,
        workdir: Path,
        printer: Printer,
        dataset: upload.Bundle | None = None,
        backend: str = "gloo",
    ) -> None:
        self.cfg, self.run_dir, self.code, self.workdir = cfg, run_dir, code, workdir
        self.dataset = dataset
        """The controller's image folder, sent to each device before it trains (`data.sync`); None: not sent."""
        self.backend = backend
        """The process-group backend every rank uses (pipeline.train.cluster.choose_backend)."""
        self.sent = {"code": sum(n.bytes_sent for n in nodes), "data": 0, "checkpoints": 0}
        """Bytes sent to the devices, by what they were: what it cost to start (and restart) the job."""
        self.minimum, self.maximum = bounds(cfg.train.devices, len(nodes))
        self.ready, self.away = nodes[: self.maximum], list(nodes[self.maximum :])
        self.printer = printer
        self.key = run_key(run_dir)
        self.token = secrets.token_hex(8)
        self.events: list[Event] = []
        self.last_step = 0
        self.rounds = 0
        self.next_copy = 0.0
        """Monotonic time before which a round in progress copies no checkpoint (:data:`COPY_SHARE`)."""
        self.port = 0
        self.tqdm_quiet = printer.output is not None

    # -- paths and state on the controller -----------------------------------------------------------------------

    @property
    def ckpt_root(self) -> Path:
        """The controller's train/checkpoints."""
        return self.run_dir / layout.CHECKPOINTS

    def resumed_step(self) -> int:
        """Step of the controller's latest complete checkpoint (0 without one)."""
        found = checkpoint.latest(self.ckpt_root)
        return checkpoint.read_meta(found)["step"] if found else 0

    # -- the job ---------------------------------------------------------------------------------------------------

    async def run(self, port: int) -> dict[str, Any]:
        """Train to the end in rounds, the rendezvous store on `port`; returns what summary.json adds about the
        cluster."""
        self.port = port
        members = [await Node.connect(check, self.key, port, self.cfg.train.link_timeout_s) for check in self.ready]
        try:
            while True:
                self.rounds += 1
                end = await self._round(members)
                if end.finished:
                    break
                members = await self._regroup(members, end)
        finally:
            await asyncio.gather(*(node.stop() for node in members))
            for node in members:
                await node.close()
        return {
            "nodes": [n.name for n in members],
            "rounds": self.rounds,
            "events": [e.record() for e in self.events],
            "bytes_sent": dict(self.sent),
        }

    async def _regroup(self, members: list[Node], end: RoundEnd) -> list[Node]:
        """The next round's devices: those left, plus those that came back; refuses to go below the minimum."""
        now, resumed = time.time(), self.resumed_step()
        for node in end.lost:
            self.events.append(Event("left", node.name, now, self.last_step, resumed))
            self.away.append(node.check)
            await node.close()
        left = [n for n in members if n not in end.lost]
        for check in end.joining:
            self.events.append(Event("joined", check.target.name, now, self.last_step, resumed))
            self.away = [c for c in self.away if c.target.name != check.target.name]
            left.append(await Node.connect(check, self.key, self.port, self.cfg.train.link_timeout_s))
        if len(left) < self.minimum:
            gone = ", ".join(n.name for n in end.lost)
            raise PipelineError(
                f"train: {gone} left; {len(left)} devices remain, below train.devices' minimum {self.minimum}"
            )
        names = ", ".join(n.name for n in left)
        self.printer.emit("controller", f"round {self.rounds + 1}: {names}, from step {resumed}", "\n")
        return left

    # -- one round -------------------------------------------------------------------------------------------------

    async def _round(self, members: list[Node]) -> RoundEnd:
        """Prepare every device, start its agent, and watch until the round ends one way or another."""
        unprepared = await self._prepare(members)
        if unprepared:
            return RoundEnd(lost=unprepared)
        pumps = await self._start(members)
        waits = {asyncio.create_task(n.exit_status()): n for n in members}
        watcher = asyncio.create_task(self._watch(members))
        try:
            end = await self._first_end(members, waits, watcher)
        finally:
            watcher.cancel()
            await asyncio.gather(*(node.stop() for node in members))
            for task in (*waits, *pumps):
                task.cancel()
        await self._collect_newest(members)
        return end

    async def _prepare(self, members: list[Node]) -> list[Node]:
        """Every device's run directory as the controller's, all at once; the bytes that cost counted. Returns the
        devices that could not be prepared (a full disk, a lost link): they leave before the round starts, as a
        device that went away does, unless too few would be left (one line naming the first, and why)."""
        found = await asyncio.gather(
            *(n.prepare(self.run_dir, self.dataset, self.workdir) for n in members), return_exceptions=True
        )
        failed: dict[str, str] = {}
        for node, sent in zip(members, found, strict=True):
            if isinstance(sent, BaseException):
                failed[node.name] = await _unprepared(node, sent)
                continue
            for what, count in sent.items():
                self.sent[what] += count
        if failed and len(members) - len(failed) < self.minimum:
            name, why = next(iter(failed.items()))
            raise PipelineError(
                f"train: {name}: cannot prepare its run directory: {why}; {len(members) - len(failed)} devices "
                f"remain, below train.devices' minimum {self.minimum}"
            )
        for name, why in failed.items():
            self.printer.emit("controller", f"{name}: cannot prepare its run directory: {why}", "\n")
        return [n for n in members if n.name in failed]

    async def _start(self, members: list[Node]) -> list[asyncio.Task[None]]:
        """Start every device's agent; returns the tasks that print their output."""
        timeout_s = self.cfg.train.timeout_s
        procs = [
            await node.start(self._script(node, len(members)), env_file(self._agent_env(node)), timeout_s)
            for node in members
        ]
        return [
            asyncio.create_task(self.printer.pump(node.name, stream))
            for node, proc in zip(members, procs, strict=True)
            for stream in (proc.stdout, proc.stderr)
        ]

    async def _first_end(
        self, members: list[Node], waits: dict[asyncio.Task[int | None], Node], watcher: asyncio.Task[RoundEnd]
    ) -> RoundEnd:
        """The round's end: the watcher's word, every agent done, or the devices whose agent failed and that no
        longer answer (an agent that failed on a device still reachable fails the job)."""
        done, _ = await asyncio.wait([*waits, watcher], return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:
            return watcher.result()
        statuses = await _exit_statuses(waits, done)
        if all(code == 0 for code in statuses.values()):
            await self._finish(members)
            return RoundEnd(finished=True)
        await asyncio.gather(*(node.stop() for node in members))
        answers = await asyncio.gather(*(n.alive() for n in members))
        lost = [n for n, alive in zip(members, answers, strict=True) if not alive]
        if not lost:
            codes = ", ".join(f"{name} {code}" for name, code in statuses.items())
            raise PipelineError(f"train: the agents failed ({codes}) with every device still reachable; see above")
        return RoundEnd(lost=lost)

    def _script(self, node: Node, nnodes: int) -> str:
        """The wrapper that starts `node`'s agent in this round of `nnodes` devices."""
        target = node.check.target
        patience = self.cfg.train.link_timeout_s + TCP_RTO_MAX_S
        torchrun = [
            *("--nproc-per-node", str(target.nproc_per_node), "--nnodes", f"{nnodes}:{nnodes}"),
            *("--rdzv-backend", "c10d", "--rdzv-id", f"{self.key}-{self.rounds}"),
            # The controller's store, through this device's SSH connection; no agent hosts one
            # (docs/torch-distributed.md#choosing-the-rendezvous-host, docs/security.md#the-rendezvous-store).
            *("--rdzv-endpoint", f"127.0.0.1:{node.store_port}"),
            # A device's rendezvous and store operations pass through its link: they wait out a blackout the job
            # rides out, and TCP's wait to send again once the link is back.
            *("--rdzv-conf", f"is_host=0,join_timeout={patience},read_timeout={patience}", "--max-restarts", "0"),
        ]
        command = torchrun_command(node.run_dir, target.python, torchrun)
        return agent_script(node.run_dir, command, self.token, target.addr)

    def _agent_env(self, node: Node) -> dict[str, str]:
        """The environment of `node`'s agent and ranks."""
        target = node.check.target
        env = {
            **self.cfg.train.env,
            **self.cfg.train.passed_env(),
            "PYTHONPATH": python_path(target, self.code.id),
            # docs/torch-distributed.md#stale-rendezvous-store-after-restarts
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": str(self.cfg.train.threads_per_rank),
            RANKS_STORE_ENV: f"127.0.0.1:{node.store_port}",
            checkpoint.PER_NODE_ENV: "1",
            BACKEND_ENV: self.backend,
        }
        if nodedata.node_local(self.cfg):
            env[DATA_LOCAL_ENV] = "1"
        if self.dataset is not None:
            env[DATA_PATH_ENV] = nodedata.tree_dir(target, self.dataset.id)
        if target.ifname:
            env |= {"GLOO_SOCKET_IFNAME": target.ifname, "NCCL_SOCKET_IFNAME": target.ifname}
        if self.tqdm_quiet:
            env["TQDM_MININTERVAL"] = "30"  # a log line per bar redraw: keep redraws rare when output is logged
        return env

    # -- while a round runs, and after the last ----------------------------------------------------------------------

    async def _watch(self, members: list[Node]) -> RoundEnd:
        """While the round runs: copy each new checkpoint; end the round when a device that left is back and a
        checkpoint newer than its return is here."""
        back: list[NodeCheck] = []
        back_at = 0
        tried = 0.0
        while True:
            await asyncio.sleep(POLL_S)
            await self._collect_newest(members, paced=not back)
            if back and self.resumed_step() > back_at:
                return RoundEnd(joining=back)
            if self.away and not back and time.monotonic() - tried > REJOIN_EVERY_S and len(members) < self.maximum:
                tried = time.monotonic()
                back = await self._ready_again(self.maximum - len(members))
                back_at = self.resumed_step()

    async def _ready_again(self, room: int) -> list[NodeCheck]:
        """Check the devices that left again; up to `room` of them that are ready."""
        checks = await asyncio.gather(*(check_one(c.target, self.code, self.workdir) for c in self.away))
        self.sent["code"] += sum(c.bytes_sent for c in checks)
        # A device back with a torch of another build is left out when it cannot join the job's backend.
        fit = [c for c in checks if c.status == "ready" and (self.backend != "nccl" or not lacks_nccl(c))]
        return fit[:room]

    async def _collect_newest(self, members: list[Node], paced: bool = False) -> None:
        """Copy the newest checkpoint the reachable devices committed, if it is newer than the controller's;
        `paced`: only once the copies so far leave the link its :data:`COPY_SHARE`."""
        latest: dict[str, int] = {}
        for node in members:
            with contextlib.suppress(*FAILURES):
                # A committed checkpoint shows its steps trained, where the log's last lines name no step.
                latest[node.name], last = await node.state()
                self.last_step = max(self.last_step, last, latest[node.name])
        best = max(latest.values(), default=-1)
        newer = best > self.resumed_step() or (best >= 0 and checkpoint.latest(self.ckpt_root) is None)
        if not newer or (paced and time.monotonic() < self.next_copy):
            return
        committed = {name for name, step in latest.items() if step == best}
        # While a round runs, one not yet committed by every device waits: a device that has not started its save
        # has no RNG file yet, and a checkpoint committed here without it stays so. The round's end takes what is.
        if paced and committed != {node.name for node in members}:
            return
        copying = 0.0
        with contextlib.suppress(*FAILURES):
            copying = await self._collect(members, best, committed)
        self.next_copy = time.monotonic() + copying * (1 / COPY_SHARE - 1)

    async def _collect(self, members: list[Node], step: int, committed: set[str]) -> float:
        """Copy checkpoint `step` from the devices into the controller's run directory, first from those that
        `committed` it; committed here once it is whole, else left to complete at the next look. Returns the
        seconds the copies took."""
        name = f"step-{step}"
        copying = 0.0
        if (self.ckpt_root / name / checkpoint.TRAINER_JSON).is_file():
            return copying
        part = self.ckpt_root / f".{name}.part"
        part.mkdir(parents=True, exist_ok=True)
        for node in sorted(members, key=lambda n: n.name not in committed):
            # A device that just left may have held nothing the checkpoint needs (rank 0 writes every replicated
            # tensor): whether the copy is whole decides, not whether every device answered. Where each device
            # saves its own (DDP), one that committed it holds it whole, and one that has not may be writing it
            # still: once whole, the others add only their ranks' RNG files, each written whole before its save.
            whole = _whole(part) and (part / checkpoint.TRAINER_JSON).is_file()
            with contextlib.suppress(*FAILURES):
                copying += await node.get_checkpoint(name, part, rng_only=whole and node.name not in committed)
        if not (part / checkpoint.TRAINER_JSON).is_file() or not _whole(part):
            return copying
        # Each file and `part` itself were synced as they were copied (Device.get); the rename is synced before
        # `latest` moves, so a power cut never leaves `latest` on a name that is not on disk.
        part.rename(self.ckpt_root / name)
        fsync_dir(self.ckpt_root)
        checkpoint.point_latest(self.ckpt_root, name)
        checkpoint.prune(self.ckpt_root, self.cfg.train.keep_checkpoints)
        return copying

    async def _finish(self, members: list[Node]) -> None:
        """After the last round: the final checkpoint, and rank 0's metrics, dataset and summary."""
        await self._collect_newest(members)
        for node in members:
            if await node.get_results(self.run_dir):
                return
        raise PipelineError("train: the agents finished but no device holds summary.json")


async def _exit_statuses(
    waits: dict[asyncio.Task[int | None], Node], done: set[asyncio.Task[Any]]
) -> dict[str, int | None]:
    """The exit status of every agent that exited (`done`), by device name. When all of those succeeded, the others'
    too, awaited: one agent finished, the others finish with it (the workers' last collective is a barrier)."""
    statuses = {waits[t].name: t.result() for t in done}
    if all(code == 0 for code in statuses.values()):
        rest = [t for t in waits if t not in done]
        statuses |= {waits[t].name: code for t, code in zip(rest, await asyncio.gather(*rest), strict=True)}
    return statuses


async def _unprepared(node: Node, err: BaseException) -> str:
    """Why `node` could not be prepared, in one line, with the space its disk has left (SFTP says only "Failure"
    when it is full); `err` raised again when it is not the device's doing (a bug here, a cancelled job)."""
    if not isinstance(err, PREPARE_FAILURES):
        raise err
    why = first_line(err, typed=not isinstance(err, PipelineError))
    root = node.check.target.root
    with contextlib.suppress(*FAILURES):
        out = await node.dev.run(f"df -Pk {shlex.quote(root)} | tail -n 1", timeout_s=10)
        fields = out.stdout.split()
        if out.ok and len(fields) > 3 and fields[3].isdigit():
            why += f" ({int(fields[3]) / 1000:.1f} MB free on the device's {root})"
    return why


def _whole(step_dir: Path) -> bool:
    """True when every file the checkpoint's metadata names is here. The metadata came from a device: a name in it
    that is not a plain file name (`../..`, an absolute path) is refused rather than looked up outside `step_dir`."""
    try:
        metadata = read_metadata(step_dir)
    except (PipelineError, OSError):
        return False
    names = {info.relative_path for info in (metadata.storage_data or {}).values()}
    for name in names:
        if not checkpoint.plain_name(name):
            raise PipelineError(f"{step_dir}/.metadata: names {name[:80]!r}, not a file of the checkpoint; refused")
    return all((step_dir / name).is_file() for name in names)
