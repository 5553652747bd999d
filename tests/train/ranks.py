"""Run a function on N real gloo ranks in fresh processes (torch.multiprocessing), without torchrun's start-up."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _enter(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
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

    `fn` must be importable by name (a module-level function): the ranks are spawned, not forked.
    """
    mp.start_processes(_enter, args=(world, free_port(), fn, args), nprocs=world, start_method="spawn")
