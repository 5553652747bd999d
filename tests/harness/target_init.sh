#!/bin/sh
# First process (pid 1) of one stand-in Jetson: it runs inside fresh mount, UTS and pid namespaces, builds the
# device's view of the filesystem from the target's host directory, then becomes the device's sshd.
# Every mount here stays inside the namespace (unshare makes them private); none reaches the host.
# Inputs (environment): TARGET_DIR (host dir of this target), STANDIN_TOOL (the stand-in tools script),
# TARGET_HOSTNAME, DEPLOY_ROOT (absolute path on the device; its parent gets a tmpfs), SSHD (sshd binary).
set -eu
D=$TARGET_DIR
hostname "$TARGET_HOSTNAME"

# /etc: an overlay, so the device gains nv_tegra_release, its hostname and its sshd files, and may write /etc,
# without touching the host's /etc. The upper layer (host dir) survives a restart, as a device's /etc does.
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$D/etc/upper,workdir=$D/etc/work" /etc

# HOST_DIRS: one per line, no spaces in them.
HOST_DIRS=${HOST_DIRS:-}

# Fresh /run (sshd's privilege-separation dir lives there), /root and /var/log, as after a boot.
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -m 755 /run/sshd /run/standin
mount --bind "$D/control" /run/standin
# Host directories the test maps in (read-only) although the fresh tmpfs below hide them, e.g. a Python under /root
# or a checkout under /tmp: held at /run/hostdirs/N, which no later tmpfs covers, and bound into place at the end.
i=0
for dir in $HOST_DIRS; do
    mkdir -p "/run/hostdirs/$i"
    mount --bind "$dir" "/run/hostdirs/$i"
    i=$((i + 1))
done
mount -t tmpfs -o mode=700 tmpfs /root
# sshd records logins in /var/log (wtmp, lastlog): keep those off the host.
mount -t tmpfs -o mode=755 tmpfs /var/log

# STAND-IN tools: systemctl and dpkg-query on PATH (and over /usr/bin's, for callers using absolute paths);
# trtexec where JetPack puts it, not on PATH (as on a real Jetson).
mount -t tmpfs -o mode=755 tmpfs /usr/local/bin
mount -t tmpfs -o mode=755 tmpfs /usr/src
mkdir -p /usr/src/tensorrt/bin
for tool in systemctl dpkg-query; do
    cp "$STANDIN_TOOL" "/usr/local/bin/$tool"
    if [ -f "/usr/bin/$tool" ]; then mount --bind "/usr/local/bin/$tool" "/usr/bin/$tool"; fi
done
cp "$STANDIN_TOOL" /usr/src/tensorrt/bin/trtexec
chmod 755 /usr/local/bin/* /usr/src/tensorrt/bin/trtexec

# Device tree (model, compatible) and thermal zones, from host dirs the test can change while the device runs.
mount -t tmpfs -o mode=755 tmpfs /sys/firmware
mkdir /sys/firmware/devicetree
mount --bind "$D/devicetree" /sys/firmware/devicetree
if [ ! -d /sys/class/thermal ]; then
    mount -t tmpfs -o mode=755 tmpfs /sys/class
    mkdir /sys/class/thermal
fi
mount --bind "$D/thermal" /sys/class/thermal

# Deploy root: the size-limited tmpfs the harness mounted at $D/disk in the fleet's namespace (it outlives restarts).
mount -t tmpfs -o mode=755 tmpfs "$(dirname "$DEPLOY_ROOT")"
mkdir "$DEPLOY_ROOT"
mount --bind "$D/disk" "$DEPLOY_ROOT"

# Last: a fresh /tmp hides the host's, where $D may live (the holds under /run keep their sources).
mount -t tmpfs -o mode=1777 tmpfs /tmp
i=0
for dir in $HOST_DIRS; do
    mkdir -p "$dir"
    mount --bind "/run/hostdirs/$i" "$dir"
    mount -o remount,bind,ro "$dir"
    i=$((i + 1))
done

cd /
exec "$SSHD" -D -e -f /etc/ssh/standin/sshd_config
