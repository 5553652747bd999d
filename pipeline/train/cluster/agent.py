"""What runs on each device of the SSH job, and what the controller shows of it: the shell wrapper around the
device's torchrun agent, and every device's output printed on the controller, each line led by the device's name.

The wrapper marks everything it starts with a token in the environment (torchrun starts its ranks in sessions of their
own, so a process group does not reach them: docs/torch-distributed.md#workers-outlive-their-agent) and kills every
marked process when the controller closes the session's stdin, when the SSH connection drops (the controller was
killed, the link died), when the remote `timeout` fires, and when the agent exits. Nothing outlives the controller's
interest in it.

A blackout is not a drop: the device's sshd hears nothing while its link is silent, so the wrapper and its ranks
wait, as the controller does for `train.link_timeout_s`. Once the controller has given up, the device learns it when
the link is back (the controller's end answers with a reset) or when its own TCP stops retrying (about 15 minutes).
"""

from __future__ import annotations

import contextlib
import re
import shlex
import sys
from collections.abc import Callable

import asyncssh

from pipeline.fleet.ssh import FAILURES

ENV_FILE = ".agent-env"
"""The agent's environment, in its run directory on the device: written there by the controller (mode 600, through
the command's stdin) and removed by the wrapper once read, so no value is ever on a command line
(docs/security.md#secrets)."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_file(env: dict[str, str]) -> str:
    """The text of ENV_FILE: one `export NAME='value'` line per variable."""
    for name in env:
        if not _NAME.fullmatch(name):  # train.env's names are checked with the config; this guards every other way in
            raise ValueError(f"not an environment variable name: {name!r}")
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in sorted(env.items()))


def torchrun_command(run_dir: str, python: str, torchrun: list[str]) -> str:
    """The shell command of a device's torchrun agent running the ranks' worker; `$me` is the device's address."""
    args = " ".join(shlex.quote(arg) for arg in torchrun)
    return (
        f'{python} -m torch.distributed.run {args} --local-addr "$me" \\\n'
        f"  -m pipeline.train.rank.worker --run-dir {shlex.quote(run_dir)}"
    )


def agent_script(run_dir: str, command: str, token: str, addr: str) -> str:
    """The shell wrapper that runs one device's `command` (a shell command line: torchrun's agent, or the federated
    client; see the module docstring), its environment read from ENV_FILE in `run_dir`, `$me` set to the address
    the other devices reach it at."""
    me = shlex.quote(addr) if addr else "$3"
    return f"""tok={token}
marked() {{ for p in /proc/[0-9]*; do
  {{ tr '\\0' '\\n' < "$p/environ"; }} 2>/dev/null | grep -qx "PIPELINE_JOB=$tok" && echo "${{p#/proc/}}"; done; }}
stop() {{ kill -s TERM $(marked) 2>/dev/null; n=0
  while [ -n "$(marked)" ] && [ $n -lt 50 ]; do sleep 0.1; n=$((n + 1)); done
  kill -s KILL $(marked) 2>/dev/null; }}
trap 'stop; exit 143' TERM INT HUP
exec 3<&0
cd {shlex.quote(run_dir)} || exit 2
. ./{ENV_FILE} || exit 2
rm -f ./{ENV_FILE}
set -- $SSH_CONNECTION
me={me}
PIPELINE_JOB=$tok {command} </dev/null 3<&- &
agent=$!
( while read -r _; do :; done; stop ) <&3 >/dev/null 2>&1 &
watcher=$!
exec 3<&-
wait $agent; rc=$?
stop
kill $watcher 2>/dev/null
exit $rc
"""


class Printer:
    """Every device's output on the controller, each line led by the device's name; rank 0's bar redraws in place.

    With `output` (a Prefect logger), complete lines go there instead and bar redraws count as lines.
    """

    def __init__(self, output: Callable[[str], None] | None) -> None:
        self.output = output
        self.in_bar = False

    def emit(self, name: str, text: str, end: str) -> None:
        """One piece of a device's output, ended by "\\n" or (a progress bar redraw) "\\r"."""
        if not text.strip():
            return
        if self.output is not None:
            self.output(f"[{name}] {text}")
            return
        if end == "\r":
            sys.stderr.write(f"\r[{name}] {text}")
            self.in_bar = True
        else:
            sys.stderr.write(("\n" if self.in_bar else "") + f"[{name}] {text}\n")
            self.in_bar = False
        sys.stderr.flush()

    async def pump(self, name: str, stream: asyncssh.SSHReader[str]) -> None:
        """Forward one stream of a device until it ends (or its connection does)."""
        pending = ""
        with contextlib.suppress(*FAILURES):
            while chunk := await stream.read(4096):
                pieces = re.split(r"([\r\n])", pending + chunk)
                pending = pieces.pop()
                for text, end in zip(pieces[::2], pieces[1::2], strict=True):
                    self.emit(name, text, end)
        self.emit(name, pending, "\n")
