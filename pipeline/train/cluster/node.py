"""One device of the SSH job as the controller holds it: its connection, its run directory and its running agent,
and the files that go between that run directory and the controller's (the config, the metrics so far and the
checkpoint training goes on from, there; checkpoint files and rank 0's results, back)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from pipeline import layout
from pipeline.errors import PipelineError
from pipeline.files import first_line, parse_json
from pipeline.fleet import upload
from pipeline.fleet.ssh import FAILURES, Device, Refused
from pipeline.train.cluster import NodeCheck, agent, nodedata, refusal
from pipeline.train.rank import checkpoint

STOP_WAIT_S = 20.0
"""How long the controller waits for a stopped device to confirm that its processes are gone."""
_STEP = re.compile(r"step-(\d+)")


@dataclass
class Node:
    """A device taking part: its check, its open connection, its run directory, its running agent."""

    check: NodeCheck
    dev: Device
    run_dir: str
    store_port: int
    """The device's loopback port that leads, through this connection, to the controller's rendezvous store."""
    proc: asyncssh.SSHClientProcess[str] | None = None

    @classmethod
    async def connect(cls, check: NodeCheck, key: str, store_port: int, link_timeout_s: int) -> Node:
        """Open the device's connection, lost once the device is silent for `link_timeout_s`, and a port on the
        device's loopback forwarded through it to the controller's rendezvous store on `store_port`
        (docs/security.md#the-rendezvous-store); the device's run directory is named `key` (the job's, the same on
        every device)."""
        target = check.target
        try:
            dev = await Device(target, command_timeout_s=300, link_timeout_s=link_timeout_s).__aenter__()
        except Refused as err:
            raise refusal(target, err) from None
        except FAILURES as err:  # it answered the check a moment ago
            raise PipelineError(f"{target.name}: unreachable: {first_line(err, typed=True)}") from None
        try:
            listener = await dev.conn.forward_remote_port("127.0.0.1", 0, "127.0.0.1", store_port)
        except asyncssh.ChannelListenError as err:
            await dev.__aexit__(None, None, None)
            raise PipelineError(
                f"{target.name}: its sshd refuses to forward a port to the controller ({err.reason}): "
                "allow it with `AllowTcpForwarding remote` (or yes) in the device's sshd_config"
            ) from None
        return cls(check, dev, f"{target.root}/train/runs/{key}", listener.get_port())

    @property
    def name(self) -> str:
        """The inventory name."""
        return self.check.target.name

    async def close(self) -> None:
        """Close the connection."""
        await self.dev.__aexit__(None, None, None)

    # -- the agent ---------------------------------------------------------------------------------------------------

    async def start(self, script: str, env: str, timeout_s: int) -> asyncssh.SSHClientProcess[str]:
        """Start the agent's wrapper `script`, stopped by the device itself after `timeout_s`; `env` is the text of
        its environment file, sent on a command's stdin so that no value is on a command line."""
        where = shlex.quote(f"{self.run_dir}/{agent.ENV_FILE}")
        await _must(self.dev, f"umask 077 && cat > {where}", stdin=env)
        self.proc = await self.dev.start(script, timeout_s)
        return self.proc

    async def exit_status(self) -> int | None:
        """The agent's exit status; None when the connection was lost (the device is gone or unreachable)."""
        assert self.proc is not None
        try:
            done = await self.proc.wait()
        except FAILURES:
            return None
        return done.exit_status

    async def alive(self) -> bool:
        """True when the device still answers a command. A silent one is given as long as its link may be silent
        (a blackout is not its end); one whose connection was lost answers False at once."""
        try:
            return (await self.dev.run("true", timeout_s=self.dev.link_timeout_s)).ok
        except FAILURES:
            return False

    async def stop(self) -> None:
        """Close the agent's stdin: the wrapper stops every process it marked; wait (bounded) until it has."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(*FAILURES, asyncssh.Error, BrokenPipeError):
            proc.stdin.write_eof()
            await asyncio.wait_for(proc.wait(), timeout=STOP_WAIT_S)
        proc.close()

    # -- files between the controller and the device -----------------------------------------------------------------

    async def prepare(self, run_dir: Path, dataset: upload.Bundle | None, workdir: Path) -> dict[str, int]:
        """The device's run directory as the controller's `run_dir`: config, metrics so far, the latest complete
        checkpoint, and the `dataset` when it is sent. Returns the bytes sent, by what they were."""
        ckpts = f"{self.run_dir}/{layout.CHECKPOINTS}"
        await _must(self.dev, f"mkdir -p {shlex.quote(ckpts)} && rm -f {shlex.quote(self.run_dir)}/{layout.SUMMARY}")
        sent = {"data": 0, "checkpoints": 0}
        if dataset is not None:  # every round: a device that comes back may have lost it (or never had it)
            sent["data"] = await nodedata.send(self.dev, dataset, workdir)
        await self.dev.put(run_dir / layout.CONFIG_SNAPSHOT, f"{self.run_dir}/{layout.CONFIG_SNAPSHOT}")
        if (run_dir / layout.METRICS).exists():
            await self.dev.put(run_dir / layout.METRICS, f"{self.run_dir}/{layout.METRICS}")
        found = checkpoint.latest(run_dir / layout.CHECKPOINTS)
        if found is not None:
            files = {p.name: p for p in sorted(found.iterdir()) if p.is_file()}
            sent["checkpoints"] = (await upload.send(self.dev, ckpts, upload.bundle(found.name, files), workdir)).bytes
        await self._keep_only(found.name if found else "")
        return sent

    async def _keep_only(self, keep: str) -> None:
        """Only the checkpoint training goes on from stays: older ones and those of an abandoned round go."""
        ckpts = f"{self.run_dir}/{layout.CHECKPOINTS}"
        await _must(
            self.dev,
            f'cd {shlex.quote(ckpts)} && for d in step-* .step-*; do [ "$d" = \'{keep}\' ] || rm -rf "$d"; done; '
            + (f"ln -sfn {keep} latest" if keep else "rm -f latest"),
        )

    async def state(self) -> tuple[int, int]:
        """(the step the device's `latest` points to, the last step in its metrics); -1 where there is none."""
        run = shlex.quote(self.run_dir)
        out = await self.dev.run(
            f"readlink {run}/{layout.LATEST}; echo; tail -n 3 {run}/{layout.METRICS} 2>/dev/null; true", timeout_s=20
        )
        lines = out.stdout.splitlines()
        return _step_of(lines[0] if lines else ""), max(map(_metrics_step, lines[2:]), default=-1)

    async def get_checkpoint(self, name: str, part: Path, rng_only: bool = False) -> float:
        """Copy the device's files of checkpoint `name` that `part` (the controller's copy in progress) lacks; with
        `rng_only`, its ranks' RNG files alone. Returns the seconds the copies took (not the wait for a device that
        was silent when asked).

        The names come from the device: every one is checked before anything is copied, and one that is not a plain
        file name of a checkpoint fails the round naming this device, with nothing written."""
        where = f"{self.run_dir}/{layout.CHECKPOINTS}/{name}"
        out = await self.dev.run(f"cd {shlex.quote(where)} 2>/dev/null && ls -A; true", timeout_s=20)
        offered = [f for f in out.stdout.splitlines() if f != upload.SUMS and not f.endswith(".tmp")]
        for file in offered:
            if not checkpoint.plain_name(file):
                raise PipelineError(
                    f"{self.name}: offered checkpoint file {file[:80]!r} for {name}: not a plain file name; "
                    "refusing to copy from a device that misbehaves"
                )
        started = time.monotonic()
        for file in offered:
            if not (part / file).exists() and (file.startswith(checkpoint.RNG_PREFIX) or not rng_only):
                await self.dev.get(f"{where}/{file}", part / file)
        return time.monotonic() - started

    async def get_results(self, run_dir: Path) -> bool:
        """Copy rank 0's metrics, dataset and summary into `run_dir`; False when this device ran no rank 0 (holds no
        summary.json)."""
        run = self.run_dir
        if not (await self.dev.run(f"test -f {shlex.quote(run)}/{layout.SUMMARY}")).ok:
            return False
        for rel in (layout.METRICS, layout.DATASET, layout.SUMMARY):
            await self.dev.get(f"{run}/{rel}", run_dir / rel)
        return True


def _metrics_step(line: str) -> int:
    """The step of a metrics line from the device; -1 for anything else (the device's word is not trusted)."""
    try:
        step = parse_json(line, "a device's metrics line").get("step", -1)
    except (PipelineError, AttributeError):
        return -1
    return step if type(step) is int else -1


def _step_of(name: str) -> int:
    match = _STEP.fullmatch(name.strip())
    return int(match[1]) if match else -1


async def _must(dev: Device, command: str, stdin: str | None = None) -> None:
    out = await dev.run(command, stdin=stdin)
    if not out.ok:
        raise PipelineError(f"{dev.target.name}: `{command[:60]}...`: {out.tail()}")
