#!/usr/bin/env bash
# Builds the QEMU + plugin baselines of tests/bench/side_by_side.py. All of them run on
# Debian's own qemu-system-x86_64 7.2, whose build loads TCG plugins (plugin API v1); no
# QEMU is compiled.
#
#   tests/bench/build-qemu-plugins.sh             # the shared bbcount and cachesim plugins
#   tests/bench/build-qemu-plugins.sh --pa-cache  # and the in-tree pa_cache.c as well
#
# The shared plugins (../shared/bench/qemu-plugins next to this repository, Rust, on the
# `qemu-plugin` crate; read-only, so built into a target directory of our own):
#   $KPIN_QEMU_PLUGINS_TARGET/release/{libbbcount.so,libcachesim.so}
#   (default KPIN_QEMU_PLUGINS_TARGET=~/.cache/kpin-qemu-plugins; cargo keeps it cached.)
#   Their source directory can be named with KPIN_QEMU_PLUGINS_SRC.
#
# --pa-cache: tests/bench/qemu-cache-plugin/pa_cache.c, our PA-tagged cache plugin, into
# images/out/qemu-plugins/plugins/libpa_cache.so. Debian ships QEMU's qemu-plugin.h in no
# binary package, so the header is taken from bookworm's qemu source package (the same
# version as qemu-system-x86; `apt-get source --download-only`, a deb-src line for bookworm
# is added under /etc/apt/sources.list.d/ if there is none: needs root and the Debian
# archive; glib's headers are installed if missing). Cached: rebuilt only when pa_cache.c
# is newer than the plugin.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

pa_cache=false
for arg in "$@"; do
    case "$arg" in
        --pa-cache) pa_cache=true ;;
        *) echo "usage: $0 [--pa-cache]" >&2; exit 2 ;;
    esac
done

src=${KPIN_QEMU_PLUGINS_SRC:-$root/../shared/bench/qemu-plugins}
target=${KPIN_QEMU_PLUGINS_TARGET:-$HOME/.cache/kpin-qemu-plugins}
if [ ! -f "$src/Cargo.toml" ]; then
    echo "build-qemu-plugins: no shared plugins at $src (set KPIN_QEMU_PLUGINS_SRC)" >&2
    exit 1
fi
(cd "$src" && CARGO_TARGET_DIR="$target" nice -n 19 cargo build --release -q)
echo "$target/release/libbbcount.so"
echo "$target/release/libcachesim.so"

$pa_cache || exit 0

out=${QEMU_PLUGINS_OUT:-$root/images/out/qemu-plugins}
plugin=$out/plugins/libpa_cache.so
header=$out/include/qemu-plugin.h
mkdir -p "$out/src" "$out/plugins" "$out/include"
if [ ! -f "$header" ]; then
    if ! grep -rqs '^Types: deb-src\|^deb-src' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        cat > /etc/apt/sources.list.d/kpin-deb-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    fi
    # An index that fails elsewhere (a mirror mid-sync) need not stop us: apt-get source
    # below says so if the Sources index we need is missing.
    apt-get update -qq || echo "build-qemu-plugins: apt-get update reported errors; going on" >&2
    # The source version of the installed binary package, so that the header is its own.
    version=$(dpkg-query -W -f='${source:Version}' qemu-system-x86)
    cd "$out/src"
    apt-get source --download-only "qemu=$version" >/dev/null
    orig=$(ls qemu_*.orig.tar.* | head -1)
    tar -xf "$orig" --no-same-owner --wildcards --strip-components=3 -C "$out/include" '*/include/qemu/qemu-plugin.h'
    # Debian's patches must not change the plugin API; refuse to build if one touches it.
    if ls qemu_*.debian.tar.* >/dev/null 2>&1 \
        && tar -xOf "$(ls qemu_*.debian.tar.* | head -1)" | grep -q '^+++ .*include/qemu/qemu-plugin.h'; then
        echo "build-qemu-plugins: a Debian patch changes qemu-plugin.h; use the patched tree" >&2
        rm -f "$header"
        exit 1
    fi
    rm -f qemu_*
fi
if [ ! -f "$plugin" ] || [ "$here/qemu-cache-plugin/pa_cache.c" -nt "$plugin" ]; then
    if ! pkg-config --exists glib-2.0 2>/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            gcc libc6-dev pkg-config libglib2.0-dev >/dev/null
    fi
    gcc -O2 -shared -fPIC -Wall -Wextra -Wno-unused-parameter -Werror -I"$out/include" \
        $(pkg-config --cflags glib-2.0) \
        -o "$plugin" "$here/qemu-cache-plugin/pa_cache.c"
fi
echo "$plugin"
