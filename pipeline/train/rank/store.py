"""The key-value stores of a training job (torch's `TCPStore`), each listening on one address only.

torch's TCPStore server listens on every interface, whatever host name it is given, and torch.distributed unpickles
what its elastic rendezvous reads from the store: a store reachable from the WiFi hands root on every device to
anyone on it (docs/security.md#the-rendezvous-store). So every store of a job is served on a socket bound here, to one
address, and handed to torch with `master_listen_fd` (the libuv backend takes one from torch 2.8, the legacy one
before):

- the rendezvous store, hosted by the controller (the launcher, or the SSH job) on 127.0.0.1; devices reach it through
  the SSH connection the controller already holds (a remote port forward), so it is never on the network;
- the ranks' own store: in the SSH job, the controller's again (each round under a prefix of its own); otherwise
  MASTER_ADDR:MASTER_PORT, which torchrun's rank-0 node picks, hosted by rank 0 on that address alone (loopback on one
  host). Only gloo's own links listen on a device, on the interface the inventory names.

A device imports this module (Python 3.10, torch 2.5).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from pipeline.errors import PipelineError

LIBUV_TAKES_A_SOCKET = (2, 8)
"""The first torch whose libuv TCPStore serves a socket handed to it (pytorch/pytorch#150215); before it, only the
legacy backend does, and libuv refuses with NotImplementedError (torch 2.5, on JetPack 6)."""


def bound_socket(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on `host` alone (port 0: any free one)."""
    try:
        return socket.create_server((host, port), backlog=1024)
    except OSError as err:
        raise PipelineError(f"cannot listen on {host}:{port}: {err.strerror}") from None


def serve(host: str, port: int = 0, world_size: int | None = None, timeout_s: float = 300) -> dist.TCPStore:
    """A TCPStore server on `host` alone; its port is `.port`. With `world_size`, waits until that many clients
    (itself included) are connected, as torch's own rank-0 store does."""
    sock = bound_socket(host, port)
    options = {
        "is_master": True,
        "timeout": datetime.timedelta(seconds=timeout_s),
        "wait_for_workers": world_size is not None,
        "master_listen_fd": sock.fileno(),
    }
    libuv = torch.__version__ >= LIBUV_TAKES_A_SOCKET  # TorchVersion compares with a tuple
    store = dist.TCPStore(host, sock.getsockname()[1], world_size, **options, use_libuv=libuv)
    sock.detach()  # the store owns the descriptor from here on, and closes it
    return store


def is_local(host: str) -> bool:
    """True when `host` is an address of this machine (a socket can be bound to it)."""
    try:
        with socket.create_server((host, 0)):
            return True
    except OSError:
        return False


def serve_if_free(host: str, port: int) -> dist.TCPStore | None:
    """A rendezvous store on `host:port` when `host` is this machine's and the port is free; None when another
    process on this machine (another node of the job, started first) holds the port already, or `host` is not
    this machine's: then this node is a client."""
    if not is_local(host):
        return None
    try:
        return serve(host, port)
    except PipelineError:
        return None


RANKS_STORE_ENV = "PIPELINE_RANKS_STORE"
"""HOST:PORT of a store the ranks meet at instead of rank 0's own: the SSH job's, which each device reaches through
the controller's connection."""


def ranks_store(timeout: datetime.timedelta) -> dist.Store:
    """The store this rank's process group meets at. In the SSH job, the controller's (RANKS_STORE_ENV), under a
    prefix of this round's own: nothing on a device listens but gloo. Otherwise torchrun's MASTER_ADDR:MASTER_PORT,
    served by rank 0 on that address only (torch's env:// would serve it on every interface)."""
    world_size = int(os.environ["WORLD_SIZE"])
    if shared := os.environ.get(RANKS_STORE_ENV):
        host, _, port = shared.rpartition(":")
        client = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
        # One round of the job is one rendezvous id, never restarted (--max-restarts 0): its own keys.
        run = f"{os.environ['TORCHELASTIC_RUN_ID']}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return dist.PrefixStore(f"ranks/{run}", client)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if int(os.environ["RANK"]) == 0:
        try:
            return serve(host, port, world_size, timeout.total_seconds())
        except PipelineError as err:
            raise PipelineError(f"rank 0: the ranks' store (MASTER_ADDR {host}): {err}") from None
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
