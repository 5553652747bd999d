"""Run a function on N real gloo ranks in fresh processes (torch.multiprocessing), without torchrun's start-up."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# The ranks are forked from a server process that imported torch and the worker once (3-5 s a process here) rather
# than spawned, each a fresh interpreter importing them again. The server is itself a fresh interpreter that runs
# nothing but those imports, so no thread pool or process group of the tests' process is forked.
START_METHOD = "forkserver"
mp.get_context(START_METHOD).set_forkserver_preload(["torch", "pipeline.train.rank.worker"])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _enter(
    rank: int, world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...], env: dict[str, str], cwd: str
) -> None:
    # A forked rank starts with the server's environment and directory: give it the caller's, as spawning would.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
        }
    )
    fn(*args)


def run_ranks(fn: Callable[..., None], *args: Any, world: int = 2) -> None:
    """Call `fn(*args)` on `world` ranks with the torchrun environment set; raises if any rank fails.

    `fn` must be importable by name (a module-level function): the ranks get it pickled, as spawned ones would.
    """
    context = (world, free_port(), fn, args, dict(os.environ), os.getcwd())
    mp.start_processes(_enter, args=context, nprocs=world, start_method=START_METHOD)
