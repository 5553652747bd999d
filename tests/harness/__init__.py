"""Stand-in Jetson devices for SSH deploy and on-device TensorRT build tests.

Each device is a real OpenSSH ``sshd`` on 127.0.0.1:<free port>, run as root in its own mount, UTS and pid
namespaces (``unshare --mount --uts --pid --fork --kill-child --mount-proc``). Inside, a device has:

- its own hostname (the target name unless ``TargetSpec.hostname``);
- ``/etc`` as an overlay on the host's, adding ``/etc/nv_tegra_release`` ("# R36 (release), REVISION: 4.3, ...");
  writes to the device's /etc land in ``<target.dir>/etc/upper`` on the host, never in the host's /etc;
- ``/sys/firmware/devicetree/base/{model,compatible,serial-number}``, NUL-terminated like the real ones
  (read the model with ``tr -d '\\0' </sys/firmware/devicetree/base/model``). ``/proc/device-tree`` does NOT
  exist: procfs cannot be given new entries. On a real Jetson it is a symlink to the sys path, so device code
  that reads the sys path works on both;
- ``/sys/class/thermal/thermal_zoneN/{type,temp}`` in millidegrees (``target.set_temperature("gpu-thermal", 71.5)``);
- the deploy root (``/opt/edge`` by default) on a tmpfs of ``TargetSpec.disk_size``: writing more fails with
  ENOSPC ("No space left on device"; over SFTP: ``SFTPFailure``). It survives ``restart()`` like a disk survives a
  reboot; ``/tmp``, ``/run``, ``/root`` and ``/var/log`` are fresh tmpfs at every boot;
- STAND-IN tools (``tests/harness/standin_tools.py``, not the real programs): ``systemctl`` and ``dpkg-query`` in
  ``/usr/local/bin`` (also bound over ``/usr/bin/...``), ``trtexec`` at ``/usr/src/tensorrt/bin/trtexec`` (not on
  PATH, as on a Jetson). They run on the host's python3, read knobs from the target's control directory and log
  every argv (``target.standins``, a :class:`StandIns`):

  - ``dpkg-query -W -f='${Package} ${Version}\\n' nvidia-jetpack tensorrt`` prints the board's versions
    (``set_packages({"tensorrt": "8.6.2.3-1+cuda12.2"})``; None removes a package: exit 1, "no packages found");
  - ``trtexec --onnx=F --saveEngine=E [--timingCacheFile=T ...]`` prints "&&&& RUNNING TensorRT.trtexec
    [TensorRT v100300] # <argv>" and "&&&& PASSED ...", and writes an engine whose header carries the TensorRT
    version (``read_plan(bytes)`` -> (version, {onnx_sha256, soc, hostname, argv}); ``make_plan`` fabricates
    one). ``--loadEngine=E`` fails like TensorRT on a version or SoC mismatch, or on a plan longer or shorter than
    its header says; ``--getPlanVersionOnly --loadEngine=E`` prints "Plan was created with TensorRT version X"; an
    option its TensorRT version lacks (docs/tensorrt.md's matrix) fails as "Unknown option". Knobs:
    ``set_trtexec(build_exit=1, load_exit=1, delay_s=2.0, engine_bytes=..., version=..., error="out of memory",
    outputs={"logits": [[...]]})`` (``outputs``: what a load writes to ``--exportOutput``; nothing by default, as the
    stand-in runs no model);
  - ``systemctl restart|start|stop|is-active|status UNIT``: unknown units fail as systemd does ("Unit X not
    found", exit 5); ``set_unit("edge.service", restart_exit=1)`` makes restart fail, ``healthy=False`` makes it
    succeed and is-active then say "failed" (exit 3). Unit states reset at each boot.

Boards: ``AGX_ORIN_JP62`` (default: L4T 36.4.3, JetPack 6.2, TensorRT 10.3.0.30), ``ORIN_NANO_JP62``,
``XAVIER_NX_JP513`` (L4T 35.5.0, TensorRT 8.5.2.2); make others with ``Board(...)`` or ``dataclasses.replace``.

Client side: one ed25519 client key per fleet (``fleet.key_path``) in every device's authorized_keys; one host key
per device; ``fleet.known_hosts_path`` lists ``[127.0.0.1]:PORT ssh-ed25519 ...`` for each device except those with
``TargetSpec(in_known_hosts=False)``. Connect with ``asyncssh.connect(**target.connect_kwargs())`` or run
``target.ssh_argv("uname -a")`` (OpenSSH, strict host key checking). ``fleet.write_inventory()`` writes the
deploy inventory TOML ([defaults] user/port/key/known_hosts/root/service/health_command, [policy], [[targets]]).

Test-side access without SSH: ``target.run("sh command")`` (nsenter into the device, returns CompletedProcess),
``target.path("/etc/nv_tegra_release")`` and ``target.disk`` (host paths through /proc/PID/root: an absolute
symlink inside resolves on the host, so follow only relative ones), ``target.dir`` (host dir with ``sshd.log``).
Faults: ``target.kill()`` (SIGKILL of the device's pid 1: every process and connection of the device dies at
once), ``target.restart()`` (same address, keys, deploy root), ``target.resize_disk("1m")``, the stand-in knobs.

Private links (``TargetSpec(network=True)``, needs iproute2): the device gets its own network namespace, joined to
the host by a veth pair with a /30 from 10.213.0.0/16 (a blackhole route for the range guards against leaks while
links exist), and is reached at ``target.host`` (10.213.x.y) port 22. ``target.link.shape("40mbit")`` limits
both directions (tbf; there is no netem here, so no added delay), ``target.link.cut()`` drops everything (connections
hang and time out, as with a pulled cable), ``target.link.heal()`` restores it.

Usage::

    from tests.harness import XAVIER_NX_JP513, JetsonFleet, TargetSpec, skip_unless_available

    def test_probe(tmp_path):
        skip_unless_available()
        specs = [TargetSpec("orin-01"), TargetSpec("nx-01", board=XAVIER_NX_JP513, disk_size="8m")]
        with JetsonFleet(tmp_path / "fleet", specs) as fleet:
            inventory = fleet.write_inventory(policy={"canary": 1})
            fleet["orin-01"].standins.set_unit("edge.service")
            ...  # run the deploy code against `inventory`
            assert fleet["orin-01"].standins.calls("systemctl")[-1][1:] == ["restart", "edge.service"]

or with the factory fixture, which skips where the harness cannot run and stops its fleets at teardown even when
the test fails. Make it visible to a test module (or conftest.py) by assignment, which linters accept::

    from tests.harness import fixtures

    jetson_fleet = fixtures.jetson_fleet

    def test_rollout(jetson_fleet):
        fleet = jetson_fleet(3)  # orin-01..03; or jetson_fleet([TargetSpec(...), ...])

Importing ``tests.harness`` needs the repository root on sys.path (pytest ``pythonpath = ["."]``).

Requirements (else ``skip_unless_available()`` skips with the reason): Linux, root, ``sshd`` (openssh-server),
``ssh-keygen`` (openssh-client), ``unshare``/``nsenter`` (util-linux), overlayfs and tmpfs; private links also
``ip``/``tc`` (iproute2). A fleet of four starts in about 0.35 s, keys included. Harness processes get a
parent-death signal (when started from the main thread), so even a test process killed outright takes its devices
with it (a blackhole route may then remain; the next fleet with links reuses and removes it).
"""

from . import fixtures, jetsons, network
from .fixtures import jetson_fleet, skip_unless_available
from .jetsons import JetsonFleet, JetsonTarget, harness_unavailable
from .network import DeviceLink
from .procs import HarnessError
from .specs import AGX_ORIN_JP62, ORIN_NANO_JP62, XAVIER_NX_JP513, Board, TargetSpec, default_specs
from .standin_tools import make_plan, read_plan
from .standins import StandIns

__all__ = [
    "AGX_ORIN_JP62",
    "ORIN_NANO_JP62",
    "XAVIER_NX_JP513",
    "Board",
    "DeviceLink",
    "HarnessError",
    "JetsonFleet",
    "JetsonTarget",
    "StandIns",
    "TargetSpec",
    "default_specs",
    "fixtures",
    "harness_unavailable",
    "jetson_fleet",
    "jetsons",
    "make_plan",
    "network",
    "read_plan",
    "skip_unless_available",
]
