#!/bin/sh
# Device side of a deploy, shipped inside every release (POSIX sh: runs on dash and BusyBox).
#
#   sh releases/<id>/activate.sh ROOT RELEASE KEEP SERVICE HEALTH_COMMAND
#   (RELEASES_DIR=releases CURRENT_LINK=current ... in its environment)
#
# The deploy root's names come in that environment, set by the controller from pipeline/layout.py
# (pipeline.deploy.remote.ACTIVATE_NAMES): none is spelled here, so the two sides cannot drift apart. This script's
# own bookkeeping (.lock, .seq, .health.log, each release's .order) is read by nothing else and is named here.
#
# Under a lock on ROOT/.lock: preflight the release (load the engine with trtexec, else HEALTH_COMMAND, else run
# the model with python3 + onnxruntime, else check the files), switch `current` to it in one rename (the old
# current becomes `previous`), restart SERVICE, post-check (unit active, HEALTH_COMMAND); on any failure switch
# both links back and restart SERVICE again. Then keep the KEEP newest releases, never current or previous.
# The controller reads the `ACTIVATE key=value` lines; the exit status is 0 only for status=ACTIVE. A HEALTH_COMMAND
# may print one `HEALTH <json>` line (local targets' health.py does): the last one comes back as `health=<json>`.
set -u
for name in RELEASES_DIR CURRENT_LINK PREVIOUS_LINK PART_SUFFIX SUMS_FILE PLAN_FILE ONNX_FILE SAMPLE_FILE; do
    eval "[ -n \"\${$name:-}\" ]" && continue
    echo "ACTIVATE status=FAILED"; echo "ACTIVATE reason=$name is not set (the controller sets it)"; exit 1
done
ROOT=$1 REL=$2 KEEP=$3 SERVICE=$4 HEALTH=$5
TRTEXEC=${TRTEXEC:-/usr/src/tensorrt/bin/trtexec}
LOG=/dev/null  # HEALTH lines `report` hands back: none until this activation holds the lock and has its own log

report() {  # status reason
    echo "ACTIVATE status=$1"
    echo "ACTIVATE current=$(readlink "$CURRENT_LINK" 2>/dev/null | sed "s|^$RELEASES_DIR/||")"
    echo "ACTIVATE previous=$(readlink "$PREVIOUS_LINK" 2>/dev/null | sed "s|^$RELEASES_DIR/||")"
    echo "ACTIVATE reason=$2"
    health=$(sed -n 's/^HEALTH //p' "$LOG" 2>/dev/null | tail -n 1)
    [ -z "$health" ] || echo "ACTIVATE health=$health"
    [ "$1" = ACTIVE ]
    exit $?
}

point() {  # link target-or-empty: one rename, so readers see the old link or the new one, never none
    if [ -z "$2" ]; then rm -f "$1"; return 0; fi
    rm -f ".$1.new" && ln -s "$2" ".$1.new" && mv -T ".$1.new" "$1"
}

durable() {  # the links, the renamed release and the activation order on disk (fsync), before anyone relies on them
    sync -- . "$RELEASES_DIR" .seq "$RELEASES_DIR/$REL/.order" 2>/dev/null || sync
}

cd "$ROOT" || { echo "ACTIVATE status=FAILED"; echo "ACTIVATE reason=no deploy root $ROOT"; exit 1; }
exec 9>.lock
if command -v flock >/dev/null 2>&1; then
    flock -w 60 9 || report FAILED "another deploy holds $ROOT/.lock"
fi
LOG=.health.log && rm -f "$LOG"
[ -d "$RELEASES_DIR/$REL" ] || report FAILED "$RELEASES_DIR/$REL is missing"

check_link() {  # name: absent, or a symlink to releases/<id>; anything else is refused, never replaced
    if [ -e "$1" ] && [ ! -L "$1" ]; then report FAILED "$1 exists and is not a symlink; refusing to replace it"; fi
    to=$(readlink "$1" 2>/dev/null)
    case $to in "") return 0 ;; "$RELEASES_DIR"/*/* | *..*) ;; "$RELEASES_DIR"/?*) return 0 ;; esac
    report FAILED "$1 points at $to, not $RELEASES_DIR/<id>"
}
check_link "$CURRENT_LINK"
check_link "$PREVIOUS_LINK"

run_health() {  # dir: the configured command, with RELEASE_DIR naming the release it checks
    RELEASE_DIR=$1 sh -c "$HEALTH" >.health.log 2>&1 || { tail -n 1 .health.log; return 1; }
}

run_model() {  # dir: the model on the stored sample through ONNX Runtime, same argmax as the stored logits
    python3 - "$1" "$SAMPLE_FILE" "$ONNX_FILE" >.health.log 2>&1 <<'EOF' || { tail -n 1 .health.log; return 1; }
import sys
import numpy as np
import onnxruntime as ort
d, sample, model = sys.argv[1:4]
s = np.load(d + "/" + sample)
out = ort.InferenceSession(d + "/" + model, providers=["CPUExecutionProvider"]).run(None, {"input": s["input"]})[0]
ok = out.shape == s["logits"].shape and out.argmax() == s["logits"].argmax() and abs(out - s["logits"]).max() <= 1e-3
sys.exit(0 if ok else "model output differs from the stored logits")
EOF
}

preflight() {  # dir
    if [ -f "$1/$PLAN_FILE" ] && [ -x "$TRTEXEC" ]; then
        "$TRTEXEC" --loadEngine="$1/$PLAN_FILE" >.health.log 2>&1 || { grep -m1 'Error' .health.log || tail -n 1 .health.log; return 1; }
    elif [ -n "$HEALTH" ]; then
        run_health "$1"
    elif command -v python3 >/dev/null 2>&1 && python3 -c 'import numpy, onnxruntime' >/dev/null 2>&1; then
        run_model "$1"
    else
        (cd "$1" && sha256sum -c "$SUMS_FILE" >/dev/null 2>&1 && [ -s "$ONNX_FILE" ]) || { echo "files do not match $SUMS_FILE"; return 1; }
    fi
}

restart() {
    [ -z "$SERVICE" ] && return 0
    out=$(systemctl restart "$SERVICE" 2>&1) || { echo "restart of $SERVICE failed: $(echo "$out" | tail -n 1)"; return 1; }
}

postcheck() {
    if [ -n "$SERVICE" ]; then
        state=$(systemctl is-active "$SERVICE" 2>/dev/null)
        [ "$state" = active ] || { echo "$SERVICE is $state after restart"; return 1; }
    fi
    [ -z "$HEALTH" ] || run_health "$ROOT/$CURRENT_LINK"
}

prune() {  # by activation order (.order, from the counter in .seq): mtimes may tie within a second
    cur=$(readlink "$CURRENT_LINK" 2>/dev/null) prev=$(readlink "$PREVIOUS_LINK" 2>/dev/null) n=0
    for dir in "$RELEASES_DIR"/*/; do
        dir=${dir%/}
        case $dir in *"$PART_SUFFIX") rm -rf "$dir"; continue ;; esac  # interrupted uploads of other releases
        [ -d "$dir" ] && echo "$(cat "$dir/.order" 2>/dev/null || echo 0) $dir"
    done | sort -rn | while read -r _ dir; do
        n=$((n + 1))
        if [ "$n" -gt "$KEEP" ] && [ "$dir" != "$cur" ] && [ "$dir" != "$prev" ]; then rm -rf "$dir"; fi
    done
}

OLD_CUR=$(readlink "$CURRENT_LINK" 2>/dev/null) OLD_PREV=$(readlink "$PREVIOUS_LINK" 2>/dev/null)
NEW="$RELEASES_DIR/$REL"  # what the links read when they point at this release
drop_release() {  # a release that failed is removed unless a link still points at it
    [ "$NEW" = "$OLD_CUR" ] || [ "$NEW" = "$OLD_PREV" ] || rm -rf "$NEW"
}

if ! why=$(preflight "$ROOT/$NEW"); then
    drop_release
    report PREFLIGHT_FAILED "preflight: $why"
fi
order=$(($(cat .seq 2>/dev/null || echo 0) + 1))
echo "$order" >.seq && echo "$order" >"$NEW/.order"  # newest, for pruning
if [ "$OLD_CUR" != "$NEW" ]; then
    { [ -z "$OLD_CUR" ] || point "$PREVIOUS_LINK" "$OLD_CUR"; } && point "$CURRENT_LINK" "$NEW" ||
        report FAILED "switch failed"
fi
durable
if ! why=$(restart) || ! why=$(postcheck); then
    [ "$OLD_CUR" != "$NEW" ] || report FAILED "after restart: $why (on the release already active)"
    point "$CURRENT_LINK" "$OLD_CUR" && point "$PREVIOUS_LINK" "$OLD_PREV" && durable
    again=$(restart) || why="$why; $again after switching back"
    drop_release
    OLD_CUR=${OLD_CUR#"$RELEASES_DIR"/}
    report ROLLED_BACK "after switch: $why; back to ${OLD_CUR:-no release}"
fi
prune
report ACTIVE ""
