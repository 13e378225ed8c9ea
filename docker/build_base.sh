#!/usr/bin/env bash
# Build a local Debian bookworm base image without an image registry:
#   debootstrap --variant=minbase bookworm DIR, then `tar -C DIR -c . | docker import - NAME`.
# It holds python3 (3.11, Debian bookworm's), python3-venv, ca-certificates and tini (an init
# that forwards signals to the node). Idempotent: does nothing if the image already exists
# (pass --force to rebuild). Needs root, debootstrap and a running docker engine.
#
#   docker/build_base.sh [--force] [IMAGE]        (default IMAGE: gasloc-base:bookworm)
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), DOCKER (default: docker).
set -euo pipefail

force=0
if [[ "${1:-}" == "--force" ]]; then force=1; shift; fi
image="${1:-gasloc-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
docker="${DOCKER:-docker}"
packages="python3,python3-venv,ca-certificates,tini"

if [[ $force -eq 0 ]] && $docker image inspect "$image" >/dev/null 2>&1; then
    echo "build_base: $image already exists (use --force to rebuild)"
    exit 0
fi
command -v debootstrap >/dev/null || {
    echo "build_base: debootstrap is missing: apt-get install -y debootstrap" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || { echo "build_base: debootstrap needs root" >&2; exit 1; }

rootfs="$(mktemp -d "${TMPDIR:-/tmp}/gasloc-base.XXXXXX")"
cleanup() {
    set +e
    # An interrupted debootstrap leaves /proc, /sys, ... mounted in the rootfs: unmount them
    # (deepest first), then remove the tree whatever happened.
    findmnt -rn -o TARGET | grep -F "$rootfs/" | sort -r | while read -r m; do umount -l "$m"; done
    rm -rf --one-file-system "$rootfs" "$rootfs.log"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

start=$SECONDS
echo "build_base: debootstrap bookworm into $rootfs (mirror $mirror)"
debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" \
    > "$rootfs.log" 2>&1 || { tail -n 30 "$rootfs.log" >&2; exit 1; }

# Updates and security fixes for later `apt-get install` in derived images (prometheus).
cat > "$rootfs/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
# Keep images small: no apt caches, lists, docs or man pages.
cat > "$rootfs/etc/apt/apt.conf.d/90gasloc-slim" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
EOF
cat > "$rootfs/etc/dpkg/dpkg.cfg.d/90gasloc-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/var/log/*.log
"$rootfs/usr/bin/python3" --version >/dev/null  # fail here, not in a later build

echo "build_base: importing $image"
tar --numeric-owner -C "$rootfs" -c . | $docker import \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
size="$($docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1 / 1e6}')"
echo "build_base: $image built in $((SECONDS - start)) s ($size)"
