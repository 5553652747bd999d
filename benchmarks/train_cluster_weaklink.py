"""Cluster training over SSH on 4 stand-in Jetsons, each on a busy-WiFi link: 20 Mbit/s with 30 ms each way.

    python benchmarks/train_cluster_weaklink.py [--job quickstart|bandwidth] [--epochs 8]
        [--methods none,star,fp16,powersgd,topk,localsgd,diloco,streaming,auto] [--set KEY=VALUE] [--out PATH.json]

What it measures (issues #14 and #31), with `pipeline train --inventory` as a user runs it:

- per `train.compression` method, at its defaults: mean s/step after the compression warm-up (the first epoch:
  steps of epoch >= 1, from `batch / samples_per_s` in metrics.jsonl) and the final validation accuracy. "Best" is
  the fastest method a step within 1 point of `none`; speed-ups are against `none` of the same run (another process
  may share the CPUs);
- per method, time to accuracy (issue #31): the validation accuracy after each epoch (the run's only evaluation)
  against the wall seconds since training started (rank 0's metrics.jsonl appearing on its device: the ranks are up
  and the data loaded; uploads and rendezvous differ with what the devices already hold, not with the method), the
  bytes rank 0 handed to collectives until then (the step lines' `comm_bytes`, summed: the method's own traffic)
  and the bytes the host ends of the links carried both ways (everything: collectives between devices, SSH,
  checkpoints copied back); the first epoch at or above `none`'s final accuracy gives the time and bytes to it
  (`to_target`, null when never), and their ratios to none's (`to_target_vs_none`). `time_to_accuracy` is the
  issue's verdict: the method (none and auto aside) first there, in <= 1/3 of none's time with <= 1/10 of its
  collective bytes, and auto within 1.2x of that method's time. The times are those of a watcher reading the
  device's log every 0.1 s, so each is up to 0.1 s late. The plot beside the JSON (same name, .png) draws each
  method's accuracy against the seconds and against the collective bytes;
- a node lost mid-run (`--kill-method`, `diloco`; `train.devices = "3:4"`, the last stand-in killed whole, as
  tests/train/cluster/test_cluster_elastic.py does, at step 44 (`--kill-at-step`), late in the second of its 23-step
  epochs, 5 steps past an outer step, 21 past the epoch's start): wall seconds from the kill to the controller's
  next round and to the next training step written after it (a device's metrics.jsonl read every 0.1 s), the steps
  lost (summary.json's event), and the final accuracy against the same method's undisturbed run;
- what starting a run sends: the first run (`none`, fresh devices) against the same run again (`none` once more, code
  and data unchanged), from the upload's own `bytes_sent` (summary.json) and from the host ends' link counters
  (/sys/class/net/jetN/statistics/{tx,rx}_bytes, summed), split at the first and the last training step.

Two jobs (`--job`), each into its own results file, on the same link and epoch count, at default knobs. The
methods that average models rather than gradients (`localsgd`, `diloco`, `streaming`) train twice the epochs, as
`train.epochs = "auto"` gives them (their Method record's `epochs_factor`): time to accuracy, not the epoch count,
decides between methods.

- `quickstart` (train_cluster_weaklink.json; latency-bound): configs/quickstart.toml's job, all 1,797 digits (1,437
  to train: 23 steps an epoch), small_cnn at 16 px, global batch 64, lr 1e-2; 8 epochs, the quickstart's count. Its
  20k parameters are 81 KB a step, some 50 ms at 20 Mbit/s against 0.75 s a step of all-reduce rounds between
  devices 121 ms apart. After the methods, `none` twice more: unchanged (what a second start sends) and losing a
  node (above).
- `bandwidth` (train_cluster_weaklink_bandwidth.json; bandwidth-bound): mobilenet_v3_small at 32 px (the digits
  scaled up), the first 720 digits (9 steps an epoch: `none`'s run alone is 5 minutes), the same batch, lr and 8
  epochs, and only the methods' runs. Its 1.53 M parameters are 6.1 MB of fp32
  gradients: a ring all-reduce over 4 ranks sends and receives 1.5 times that on every device's link, about 3.7 s a
  step at 20 Mbit/s, against about 0.2 s of compute for the whole global batch on 2 cores (measured here: 72 steps
  on 2 local ranks, 0.21 s a step; it reached 0.972 after 8 epochs, 0.868 after 5, a curve that still climbs, so
  the epoch each method gets there differs). resnet18 at 32 px would be more bandwidth-bound still, but its 44.7 MB
  of gradients are some 27 s a step for `none`: over half an hour for its run alone.

Both train on the built-in digits, written as an image folder (one PNG per digit, by class; `data.augment = false`,
as the quickstart's tensor digits get no augmentation) so that `data.sync = true` has the controller send the data;
every device runs one rank with this venv's Python (tests/harness: a real sshd per device in its own namespaces
with a private disk; tests/train/cluster/test_cluster.py's `start_cluster`).

Until the upload sent several files at once (pipeline/fleet/upload.py, PUTS_IN_FLIGHT), the quickstart job used the
first 720 digits too: one file at a time, several round trips each, the first run spent about 4 minutes sending them.
Its 9 steps an epoch made each epoch's fixed costs on this link (the settling outer step, BatchNorm recalibration,
validation and the checkpoint: about 1.5 s, measured per phase) most of `diloco`'s epoch, and its 144 validation
images made a ratio move by a tenth with one image (docs/measurements.md#the-cluster-benchmark-on-the-whole-digits).

The link. Each stand-in has its own network namespace joined to the host by a veth pair (tests/harness/network.py
`DeviceLink`); the host forwards between the pairs, so device-to-device traffic crosses two links. Both veth ends
get `tc tbf` at 20 Mbit/s (`DeviceLink.shape`). This kernel has no netem, so the delay is benchmarks/weaklink.py's
shim: in each DEVICE's namespace, the routes to 10.213.0.0/16 and to the host end's /32 point into a TUN device, and
the shim sends each packet, 60 ms late, out of eth0 to the host end's MAC (an AF_PACKET send goes through eth0's
tbf). The delay is on device egress only: one shim per device then gives every path its delay (below), and the
host's own namespace, which the controller and the rest of the machine use, gets no TUN routes (its ends of the
links get only the MTU and tbf). The effect is the same as 30 ms on each link each way:

- device -> device, one way: 60 ms (device egress) = 30 ms on each of the two links it crosses;
- device <-> controller, round trip: 60 ms (the device's reply or request) = 30 ms each way.

MTU 65000 on both veth ends (host ends included) and on the TUN device keeps the Python shim to a few packets per
step, as in weaklink.py, at some cost in realism (real WiFi carries 1500-byte frames). The link is measured before
training (TCP RTT of 64-byte exchanges and 2 s bulk transfers both ways, host <-> node-1 and node-1 <-> node-2)
and recorded. Writes the job's results file and plot and prints a table. Root only; every namespace,
shim and stand-in it starts is removed on exit, Ctrl-C and failure included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "hooks"))  # benchmark_tables: the table the docs page generates

from benchmark_tables import train_cluster_weaklink as table  # noqa: E402
from benchmarks.weaklink import measure_path, start_shim, stop_shim, tun_lines, unavailable  # noqa: E402
from pipeline import layout  # noqa: E402
from pipeline.config import toml_value  # noqa: E402
from pipeline.files import read_json  # noqa: E402
from pipeline.train.compression import registry  # noqa: E402
from tests.harness import DeviceLink, JetsonFleet, JetsonTarget, harness_unavailable, network  # noqa: E402
from tests.train.cluster.test_cluster import inventory, marked_processes, pipeline_cmd, start_cluster  # noqa: E402
from tests.train.cluster.test_cluster_elastic import Output  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEVICES = 4
POLL_S = 0.1
"""How often the watcher reads the link counters and the devices' metrics.jsonl: the resolution of its times."""
RUN_TIMEOUT_S = 1800
METHODS = "none,star,fp16,powersgd,topk,localsgd,diloco,streaming,auto"


@dataclass(frozen=True)
class Job:
    """What every method's run trains (the docstring says why each)."""

    model: str
    image_size: int
    results: str
    """benchmarks/results/<results>.json, and the plot beside it (.png)."""
    extras: bool
    """Whether `none` runs twice more after the methods: unchanged (what a second start sends) and losing a node."""
    images: int
    """Of the 1,797 digits, the first this many (`--images` overrides)."""


JOBS = {
    "quickstart": Job("small_cnn", 16, "train_cluster_weaklink", extras=True, images=1797),
    "bandwidth": Job("mobilenet_v3_small", 32, "train_cluster_weaklink_bandwidth", extras=False, images=720),
}


# -- the link ------------------------------------------------------------------------------------------------------


def _nsenter(link: DeviceLink) -> list[str]:
    return ["nsenter", f"--net={link.netns}", "--"]


def weaken(link: DeviceLink, rate: str, delay_ms: float, mtu: int, queue_ms: float) -> subprocess.Popen[str]:
    """Shape `link` (tbf at `rate` on both ends) and delay the device's egress by `delay_ms` with a shim in its
    namespace; returns the shim (stop it with weaklink's `stop_shim`)."""
    subprocess.run(["ip", "link", "set", link.host_if, "mtu", str(mtu)], check=True)
    # rp_filter off: replies from the host arrive on eth0, but the route back to their source is via tun0.
    link.in_device(
        f"ip link set eth0 mtu {mtu}; echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter; "
        "echo 0 > /proc/sys/net/ipv4/conf/eth0/rp_filter"
    )
    link.shape(rate, burst=str(2 * (mtu + 14)), latency=f"{queue_ms:g}ms")  # burst must hold the largest frame
    routes = [str(network.RANGE), f"{link.host_ip}/32"]  # the /32 beats eth0's own /30 to the host end
    link.in_device(f"ip -batch - <<'EOF'\n{tun_lines(mtu, routes, link.device_ip)}EOF")
    host_mac = Path(f"/sys/class/net/{link.host_if}/address").read_text().strip()
    own = re.search(r"link/ether (\S+)", link.in_device("ip -o link show eth0"))
    if own is None:
        raise RuntimeError(f"{link.host_if}: no MAC address on the device's eth0")
    return start_shim(_nsenter(link), host_mac, own[1], delay_ms)


@contextlib.contextmanager
def weak_cluster(directory: Path, rate: str, delay_ms: float, mtu: int, queue_ms: float) -> Iterator[JetsonFleet]:
    """DEVICES forwarded, shaped and delayed stand-ins; stops the shims, the devices and their links on exit."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(network.ip_forwarding())
        fleet = start_cluster(lambda specs: stack.enter_context(JetsonFleet(directory, specs)), DEVICES)
        for target in fleet:
            assert target.link is not None
            stack.callback(stop_shim, weaken(target.link, rate, delay_ms, mtu, queue_ms))
        yield fleet


def measure_links(fleet: JetsonFleet, seconds: float) -> dict[str, Any]:
    """RTT and throughput host <-> node-1 and node-1 <-> node-2 (one path through the host)."""
    first, second = (t.link for t in fleet.targets[:2])
    assert first is not None and second is not None
    paths = {
        "controller_node1": measure_path([], _nsenter(first), first.device_ip, seconds),
        "node1_node2": measure_path(_nsenter(first), _nsenter(second), second.device_ip, seconds),
    }
    return {
        name: {"rtt_ms_median": statistics.median(m["rtt_ms"]), "rtt_ms_min": min(m["rtt_ms"]), **m}
        for name, m in paths.items()
    }


# -- one training run ------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One look at the link counters and the devices' training logs."""

    t: float
    tx: int
    """Bytes the host ends sent toward the devices (the controller's, and other devices' forwarded)."""
    rx: int
    """Bytes the host ends received from the devices."""
    logs: dict[str, tuple[int, int, int]]
    """Device name -> (inode, highest step, validation lines) of its metrics.jsonl, where it has one."""

    @property
    def step(self) -> int:
        """The highest step any device's log showed (0 before the first)."""
        return max((step for _, step, _ in self.logs.values()), default=0)

    @property
    def validated(self) -> int:
        """The most validation lines (one an epoch) any device's log showed."""
        return max((count for _, _, count in self.logs.values()), default=0)

    @property
    def link(self) -> int:
        """Bytes the host ends carried both ways."""
        return self.tx + self.rx

    def stepped_past(self, step: int, before: dict[str, tuple[int, int, int]]) -> bool:
        """Whether a device's log, rewritten since `before` (another inode: a new round), is past `step`."""
        return any(ino != before.get(name, (0,))[0] and s > step for name, (ino, s, _) in self.logs.items())


@dataclass
class Watcher:
    """Samples the link counters and every live device's metrics.jsonl every POLL_S in a thread, while inside."""

    fleet: JetsonFleet
    run_name: str
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _seen: dict[Path, tuple[int, int, int, int]] = field(default_factory=dict)

    def __enter__(self) -> Watcher:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self._sample())  # the counters at the end, for the last phase

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            self.samples.append(self._sample())

    def _sample(self) -> Sample:
        tx = rx = 0
        for target in self.fleet:
            assert target.link is not None
            stats = Path(f"/sys/class/net/{target.link.host_if}/statistics")
            tx += int((stats / "tx_bytes").read_text())
            rx += int((stats / "rx_bytes").read_text())
        logs = {t.name: log for t in self.fleet if t.running and (log := self._log(t)) is not None}
        return Sample(time.time(), tx, rx, logs)

    def _log(self, target: JetsonTarget) -> tuple[int, int, int] | None:
        """(inode, highest step, validation lines) of the device's rank-0 log of this run; read again only when it
        changed."""
        try:
            path = next((target.disk / "train/runs").glob(f"{self.run_name}-*/train/metrics.jsonl"))
            st = path.stat()
        except (OSError, StopIteration):  # not there yet, or the device is gone
            return None
        key = (st.st_ino, st.st_size)
        if self._seen.get(path, (0, 0))[:2] != key:
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
            steps = max((r.get("step", 0) for r in lines), default=0)
            self._seen[path] = (*key, steps, sum("val_accuracy" in r for r in lines))
        _, _, steps, validated = self._seen[path]
        return st.st_ino, steps, validated

    def step(self) -> int:
        """The highest step any device's log shows now."""
        return self.samples[-1].step if self.samples else 0


def phases(samples: list[Sample], start: Sample) -> dict[str, dict[str, int]]:
    """Host-end bytes (tx: toward the devices, rx: back) before the first step, while training, and after."""
    stepping = [s for s in samples if s.step > 0]
    top = max((s.step for s in stepping), default=0)
    first = stepping[0] if stepping else samples[-1]
    last = next((s for s in stepping if s.step == top), samples[-1])
    cuts = [start, first, last, samples[-1]]
    names = ("before_first_step", "training", "after_last_step")
    return {name: {"tx": b.tx - a.tx, "rx": b.rx - a.rx} for name, a, b in zip(names, cuts[:-1], cuts[1:], strict=True)}


def settings(job: Job, method: str, epochs: int, data: Path, devices: str) -> list[str]:
    """`--set` arguments: `job` on the digits folder sent by the controller, with `method`."""
    values: dict[str, Any] = {"data.source": "imagefolder", "data.path": str(data), "data.sync": True}
    # The quickstart's digits get no augmentation (tensor source, augment_shift 0); an image folder would get random
    # crops down to 35% of the area, which on 8x8 digits held the accuracy near 0.6 after 6 epochs.
    values["data.augment"] = False
    values |= {"model.name": job.model, "data.image_size": job.image_size}
    # What `train.epochs = "auto"` gives each method where it gives DDP `epochs` (pipeline/train/rank/plan.py).
    epochs *= registry.METHODS[method].epochs_factor
    values |= {"train.epochs": epochs, "train.compression": method, "train.devices": devices}
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={toml_value(value)}")]


def summarise(records: list[dict[str, Any]], run_dir: Path) -> dict[str, Any]:
    """s/step after the warm-up epoch, steps, final accuracy and what starting the run sent, from the run's metrics
    `records` and summary."""
    steps = [r for r in records if "samples_per_s" in r]
    timed = [r["batch"] / r["samples_per_s"] for r in steps if r["epoch"] >= 1] or [0.0]  # 0: a 1-epoch run
    summary = read_json(run_dir / layout.SUMMARY)
    return {
        "steps": max(r.get("step", 0) for r in records),
        "s_per_step": statistics.fmean(timed),
        "median_s_per_step": statistics.median(timed),
        "bytes_per_step": statistics.fmean([r["comm_bytes"] for r in steps if r["epoch"] >= 1] or [0]),
        "val_accuracy": summary["val_accuracy"],
        "bytes_sent": summary["bytes_sent"],
        "events": summary.get("events", []),
        # train.balance: the epochs after which the devices' shares of the batch were not equal (0: never moved).
        "unequal_share_epochs": sum(len(set(r.get("next_batches") or [0])) > 1 for r in records),
    }


def train(fleet: JetsonFleet, inv: Path, run_dir: Path, args: list[str], kill_at_step: int = 0) -> dict[str, Any]:
    """One `pipeline train --inventory` run into `run_dir`; with `kill_at_step`, the last stand-in is killed once a
    device's log shows that step, and the times from the kill to the next round and the next step are added."""
    cmd = pipeline_cmd("train", "--inventory", str(inv), "--run-dir", str(run_dir), *args)
    lost: dict[str, Any] = {}
    with Watcher(fleet, run_dir.name) as watch:
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = Output(proc)
        try:
            if kill_at_step:
                lost = _lose_a_node(fleet, watch, output, proc, kill_at_step)
            proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:  # Ctrl-C or a failure here: the device-side wrappers end the ranks
                proc.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(60)
                proc.kill()
    wall = time.time() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir.name}: exit {proc.returncode}\n{output.text()[-3000:]}")
    if left := marked_processes(fleet):
        raise RuntimeError(f"{run_dir.name}: training processes left on devices: {left}")
    start_sample = next((s for s in watch.samples if s.t >= start), watch.samples[0])
    records = [json.loads(line) for line in (run_dir / layout.METRICS).read_text().splitlines()]
    row = {**summarise(records, run_dir), "wall_s": wall, "link_bytes": phases(watch.samples, start_sample), **lost}
    curve = accuracy_curve(records, validations_seen(watch.samples, start))
    # `auto` probes the link and the compute before rank 0's log exists: its seconds and bytes count too.
    choice = read_json(run_dir / layout.SUMMARY).get("compression_choice") or {}
    for point in curve:
        point["wall_s"] += choice.get("probe_s", 0.0)
        point["comm_bytes"] += choice.get("probe_bytes", 0)
    return row | {"curve": curve, "probe": {k: choice.get(k) for k in ("method", "probe_s", "probe_bytes")}}


def _lose_a_node(
    fleet: JetsonFleet, watch: Watcher, output: Output, proc: subprocess.Popen[str], at_step: int
) -> dict[str, Any]:
    """Kill the last stand-in once training reaches `at_step`; times from the kill to the regroup and next step."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while watch.step() < at_step:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended before step {at_step}:\n{output.text()[-3000:]}")
        time.sleep(POLL_S / 2)
    victim = fleet.targets[-1]
    before = dict(watch.samples[-1].logs)
    killed = time.time()
    victim.kill()
    line = output.wait_for("round 2:", proc, timeout_s=600)
    regrouped = time.time()  # Output polls every 0.2 s: this is up to 0.2 s late
    resumed = int(re.search(r"from step (\d+)", line)[1])  # type: ignore[index]
    # The next step: a survivor's log rewritten for the new round (new inode) with a step past the checkpoint.
    while (hit := next((s for s in watch.samples if s.t > killed and s.stepped_past(resumed, before)), None)) is None:
        if proc.poll() is not None:
            raise RuntimeError(f"no training step after the regroup:\n{output.text()[-3000:]}")
        time.sleep(POLL_S)
    return {
        "victim": victim.name,
        "killed_at_step": at_step,
        "kill_to_regroup_s": regrouped - killed,
        "kill_to_next_step_s": hit.t - killed,
    }


# -- time to accuracy ------------------------------------------------------------------------------------------------


def validations_seen(samples: list[Sample], start: float) -> list[tuple[float, int]]:
    """For each validation line in order: (seconds, host-end bytes both ways) from the first sample after `start`
    that showed the rank-0 log (training starts: the ranks are up, the data loaded) to the first that showed that
    line. Upload, device checks and rendezvous are left out: they differ with what the devices already hold, not
    with the method."""
    logged = [s for s in samples if s.t >= start and s.logs]
    if not logged:
        return []
    first, top = logged[0], max(s.validated for s in logged)
    return [next((s.t - first.t, s.link - first.link) for s in logged if s.validated > k) for k in range(top)]


def accuracy_curve(records: list[dict[str, Any]], seen: list[tuple[float, int]]) -> list[dict[str, Any]]:
    """One point per validation line of metrics.jsonl `records`: its epoch, the step before it, its accuracy, the
    bytes rank 0 handed to collectives until then (the step and epoch lines' `comm_bytes`, summed: an epoch line's
    are the averaging that made the ranks' models one before validation), and `seen`'s wall seconds and link bytes
    for it."""
    points: list[dict[str, Any]] = []
    step = sent = 0
    for r in records:
        sent += r.get("comm_bytes", 0)
        if "val_accuracy" in r:
            points.append({"epoch": r["epoch"], "step": step, "val_accuracy": r["val_accuracy"], "comm_bytes": sent})
        else:
            step = r.get("step", step)
    return [p | {"wall_s": t, "link_bytes": b} for p, (t, b) in zip(points, seen, strict=True)]


def to_target(curve: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first point of `curve` at or above `target` accuracy; None when the run never got there."""
    return next((p for p in curve if p["val_accuracy"] >= target), None)


def against(point: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """`point`'s wall seconds, collective bytes and link bytes, each over `base`'s."""
    return {key: point[key] / base[key] for key in ("wall_s", "comm_bytes", "link_bytes")}


def verdict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue #31's done-when against the `none` of these `runs` (the methods' runs, `none` first): the method, `none`
    and `auto` aside, that reached none's final accuracy soonest, its time and bytes over none's, auto's time over
    its, and whether that is within 1/3 of the time, 1/10 of the bytes and 1.2x."""
    reached = [r for r in runs[1:] if r["method"] != "auto" and r["to_target"]]
    if not reached:
        return {"best": None, "met": False}
    best = min(reached, key=lambda r: r["to_target"]["wall_s"])
    vs = best["to_target_vs_none"]
    auto = next((r["to_target"] for r in runs if r["method"] == "auto" and r["to_target"]), None)
    auto_ratio = auto["wall_s"] / best["to_target"]["wall_s"] if auto else None
    met = vs["wall_s"] <= 1 / 3 and vs["comm_bytes"] <= 1 / 10 and auto_ratio is not None and auto_ratio <= 1.2
    return {
        "best": best["method"],
        **{f"{k}_vs_none": v for k, v in vs.items()},
        "auto_vs_best": auto_ratio,
        "met": met,
    }


def plot(runs: list[dict[str, Any]], target: float, title: str, path: Path) -> None:
    """Validation accuracy of each run against wall seconds since training started, and against the bytes rank 0
    handed to collectives (log scale); none's final accuracy dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for r in runs:
        accuracy = [p["val_accuracy"] for p in r["curve"]]
        by_time.plot([p["wall_s"] for p in r["curve"]], accuracy, marker="o", markersize=3, label=r["method"])
        by_bytes.plot([p["comm_bytes"] / 1e6 for p in r["curve"]], accuracy, marker="o", markersize=3)
    for ax in (by_time, by_bytes):
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="none's final accuracy")
        ax.grid(alpha=0.3)
    by_bytes.set_xscale("log")
    by_time.set(xlabel="wall seconds since training started", ylabel="validation accuracy (each epoch)")
    by_bytes.set(xlabel="MB rank 0 sent to collectives (log)")
    by_time.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the benchmark ---------------------------------------------------------------------------------------------------


def digits_folder(path: Path, count: int) -> Path:
    """The first `count` of scikit-learn's bundled digits as an image folder (path/<digit>/<index>.png, 8x8 grey),
    for `data.sync`."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for index, (image, label) in enumerate(zip(digits.images[:count], digits.target[:count], strict=True)):
        folder = path / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 255 / 16).round().astype("uint8"), mode="L").save(folder / f"{index:04d}.png")
    return path


def bench(args: argparse.Namespace, tmp: Path, result: dict[str, Any]) -> None:
    """Build the cluster, measure the link, run every job, filling `result` and writing it (and the plot) after each
    job (a run cut short by a failure still leaves what it measured)."""
    data = digits_folder(tmp / "digits", args.images)
    started = time.time()
    with weak_cluster(tmp / "fleet", args.rate, args.delay_ms, args.mtu, args.queue_ms) as fleet:
        inv = inventory(fleet, tmp / "cluster.toml")
        result["link"] = measure_links(fleet, args.link_seconds)
        print(f"[{time.strftime('%H:%M:%S')}] link: {json.dumps(result['link'])}", file=sys.stderr, flush=True)
        save(args.out, result)
        # (label, method, kill at step, its own settings): "streaming:train.stream_delay_steps=7" is a variant.
        jobs: list[tuple[str, str, int, list[str]]] = []
        for entry in args.methods:
            method, *own = entry.split(":")
            jobs.append((entry, method, 0, own))
        if args.job.extras:
            jobs.append(("none (again)", "none", 0, []))
        if args.job.extras and args.kill_at_step:
            jobs.append((f"{args.kill_method}, node lost", args.kill_method, args.kill_at_step, []))
        rows: list[dict[str, Any]] = []
        for name, method, kill_at, own in jobs:
            print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
            devices = f"{DEVICES - 1}:{DEVICES}" if kill_at else str(DEVICES)
            run_dir = tmp / f"run-{len(rows)}"
            run_dir.mkdir()
            row = {"run": name, "method": name if own else method}
            values = settings(args.job, method, args.epochs, data, devices)
            values += [a for kv in args.set + own for a in ("--set", kv)]
            row |= train(fleet, inv, run_dir, values, kill_at)
            rows.append(row)
            print(f"  {json.dumps(row)}", file=sys.stderr, flush=True)
            result |= score(rows, len(args.methods)) | {"runs": rows, "bench_wall_s": time.time() - started}
            save(args.out, result)
            title = f"{args.job_name}: {result['model']} @ {args.job.image_size} px, {DEVICES} devices, {args.rate}"
            plot(rows[: len(args.methods)], result["target_accuracy"], title, args.out.with_suffix(".png"))


def score(rows: list[dict[str, Any]], methods: int) -> dict[str, Any]:
    """Each of `rows` against the first (`none`): speed-up, accuracy, and time and bytes to none's final accuracy;
    then the fastest method a step within 1 point of none and issue #31's verdict over the first `methods` rows."""
    base, target = rows[0], rows[0]["val_accuracy"]
    base_reached = to_target(base["curve"], target)
    for r in rows:
        r["speedup"] = base["s_per_step"] / r["s_per_step"] if r["s_per_step"] else 0.0
        r["accuracy_delta"] = r["val_accuracy"] - target
        r["to_target"] = reached = to_target(r["curve"], target)
        r["to_target_vs_none"] = against(reached, base_reached) if reached and base_reached else None
    within = [r for r in rows[:methods] if r["accuracy_delta"] >= -0.01]
    best = min(within, key=lambda r: r["s_per_step"])["method"]
    return {"best": best, "target_accuracy": target, "time_to_accuracy": verdict(rows[:methods])}


def save(path: Path, result: dict[str, Any]) -> None:
    """Write the JSON document (again)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "load_average_1m": os.getloadavg()[0]}, indent=2) + "\n")


def done(verdict: dict[str, Any]) -> str:
    """Issue #31's done-when in words, from `verdict()`."""
    if verdict["best"] is None:
        return "no method but none reached it"
    ratio = verdict["auto_vs_best"]
    auto = "auto not there (or not run)" if ratio is None else f"auto {ratio:.2f}x its time"
    met = "met" if verdict["met"] else "not met"
    return (
        f"{verdict['best']} first, in {verdict['wall_s_vs_none']:.2f}x none's time with "
        f"{verdict['comm_bytes_vs_none']:.3f}x its bytes; {auto} (<= 1/3, <= 1/10, <= 1.2x: {met})"
    )


def main() -> None:
    """Parse the arguments, run the benchmark, write the JSON, print the table (the one docs/how-to/compression.md
    generates from it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=JOBS, default="quickstart", help="what to train (see above; quickstart)")
    parser.add_argument("--epochs", type=int, default=8, help="DDP's (default 8: `auto` would make 14, see above)")
    parser.add_argument("--images", type=int, help="of the 1,797 digits (default: the job's, see the docstring)")
    parser.add_argument(
        "--methods",
        default=METHODS,
        help=f"comma-separated, none first; METHOD:KEY=VALUE is a variant with a setting of its own ({METHODS})",
    )
    parser.add_argument("--rate", default="20mbit", help="tbf rate on both ends of each link (default 20mbit)")
    parser.add_argument("--delay-ms", type=float, default=60.0, help="device egress delay (default 60 = 30 each way)")
    parser.add_argument("--queue-ms", type=float, default=50.0, help="tbf queue before drops (default 50)")
    parser.add_argument("--mtu", type=int, default=65000)
    parser.add_argument("--link-seconds", type=float, default=2.0, help="of each bulk transfer of the link check")
    parser.add_argument("--kill-at-step", type=int, default=44, help="node-loss run, quickstart: kill then (0: none)")
    parser.add_argument("--kill-method", default="diloco", help="the node-loss run's method (default diloco)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for every run, as "
        "`pipeline train --set` takes it (a knob's other value, e.g. train.stream_delay_steps=7)",
    )
    parser.add_argument("--out", type=Path, help="the JSON (default benchmarks/results/<the job's>.json); plot beside")
    args = parser.parse_args()
    args.methods = args.methods.split(",")
    if args.methods[0] != "none":
        parser.error("--methods must start with none: speed-ups and accuracy are measured against it")
    args.job_name, args.job = args.job, JOBS[args.job]
    args.images = args.images or args.job.images
    args.out = args.out or RESULTS / f"{args.job.results}.json"
    if why := unavailable() or harness_unavailable(network=True):
        sys.exit(f"error: {why}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the with-blocks still tear everything down
    result = {"job": args.job_name, "devices": DEVICES, "ranks_per_device": 1, "model": args.job.model}
    result |= {"data": f"{args.images} digits as PNG @{args.job.image_size}px, synced"}
    result |= {"epochs": args.epochs, "rate": args.rate, "device_egress_delay_ms": args.delay_ms, "mtu": args.mtu}
    result |= {"queue_ms": args.queue_ms, "cpus": os.cpu_count(), "set": args.set}
    with tempfile.TemporaryDirectory() as tmp:
        bench(args, Path(tmp), result)
    print(table(result))
    print(f"best: {result['best']} (fastest a step within 1 point of none)")
    print(f"time to none's final accuracy {result['target_accuracy']:.4f}: {done(result['time_to_accuracy'])}")


if __name__ == "__main__":
    main()
