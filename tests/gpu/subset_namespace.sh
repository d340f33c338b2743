#!/bin/sh
# Run a command as a container given some of this machine's GPUs sees them (issue 37), on a real
# NVIDIA host, as root:
#   tests/gpu/subset_namespace.sh KEEP -- CMD [ARG...]
# KEEP: comma-separated minor numbers whose /dev/nvidia<minor> stays (`-`: none). In a private
# mount namespace, /dev is an overlay of the host's /dev in which the other /dev/nvidia<minor>
# nodes are removed (whiteouts in the overlay only); /dev/pts, /dev/shm, /dev/mqueue and
# /dev/hugepages are bound back in. /proc/driver/nvidia stays the host's, unmasked, as LXC shows
# it. Nothing outside the namespace changes: the host's /dev is the overlay's read-only lower layer,
# and the upper layer lives in a temporary directory removed at the end.
set -eu
[ "$(id -u)" = 0 ] || { echo "run as root" >&2; exit 2; }
if [ $# -lt 3 ] || [ "$2" != "--" ]; then
    echo "usage: $0 KEEP -- CMD [ARG...]" >&2
    exit 2
fi
keep=$1
shift 2
work=$(mktemp -d /tmp/zeromib-subset.XXXXXX)
# Never recursive: keep/ is only a mount point inside the namespace, and must be empty out here.
trap 'rm -rf "$work/upper" "$work/work" "$work/params"; rmdir "$work/keep" "$work"' EXIT
rc=0
# The inner script expands its own variables (single quotes on purpose).
# shellcheck disable=SC2016
unshare --mount --propagation private sh -eu -c '
    keep=$1 work=$2
    shift 2
    mkdir "$work/upper" "$work/work" "$work/keep"
    mount --rbind /dev "$work/keep"
    mount -t overlay overlay -o "lowerdir=/dev,upperdir=$work/upper,workdir=$work/work" /dev
    for sub in pts shm mqueue hugepages; do
        if [ -d "$work/keep/$sub" ] && mountpoint -q "$work/keep/$sub"; then
            mount --rbind "$work/keep/$sub" "/dev/$sub"
        fi
    done
    # As libnvidia-container does: the driver must not create the missing nodes again (as root
    # nvidia-smi would mknod /dev/nvidia<minor> back; a container device cgroup would then still
    # refuse it, this namespace has none).
    if [ -f /proc/driver/nvidia/params ]; then
        sed "s/^ModifyDeviceFiles: 1\$/ModifyDeviceFiles: 0/" /proc/driver/nvidia/params > "$work/params"
        mount --bind "$work/params" /proc/driver/nvidia/params
    fi
    for node in /dev/nvidia[0-9]*; do
        minor=${node#/dev/nvidia}
        case ",$keep," in
            *",$minor,"*) ;;
            *) rm -f "$node" ;;
        esac
    done
    exec "$@"
' sh "$keep" "$work" "$@" || rc=$?
exit "$rc"
