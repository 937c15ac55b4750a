#!/usr/bin/env bash
# Builds QEMU with the TCG plugin API (Debian's qemu-system-x86 7.2 is configured without
# it) from Debian bookworm's own source package, x86_64-softmmu only, no docs, and the
# PA-tagged cache plugin tests/bench/qemu-cache-plugin/pa_cache.c against it, and QEMU's own
# block-counting test plugin (tests/plugin/bb.c, `inline=on`: block and instruction totals
# counted by inline TCG ops) for the bbcount comparison.
#
#   tests/bench/build-qemu-plugins.sh   # -> images/out/qemu-plugins/{bin,plugins/libpa_cache.so,libbb.so}
#
# Needs root (apt-get build-dep / install) and the Debian archive (a deb-src line for
# bookworm is added under /etc/apt/sources.list.d/ if there is none). Cached: a second run
# with the binary and plugin present does nothing. Nice'd, one job per core.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${QEMU_PLUGINS_OUT:-$root/images/out/qemu-plugins}
bin=$out/bin/qemu-system-x86_64
plugin=$out/plugins/libpa_cache.so
mkdir -p "$out/src" "$out/bin" "$out/plugins"

if [ ! -x "$bin" ]; then
    if ! grep -rqs '^Types: deb-src\|^deb-src' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        cat > /etc/apt/sources.list.d/kpin-deb-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    fi
    apt-get update -qq
    # Only what x86_64-softmmu with plugins needs (not the full build-dep set, which pulls
    # in every target's firmware toolchains and the docs).
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        dpkg-dev ninja-build meson pkg-config python3-venv libglib2.0-dev libpixman-1-dev \
        zlib1g-dev libfdt-dev flex bison >/dev/null
    cd "$out/src"
    if ! ls -d qemu-*/ >/dev/null 2>&1; then
        apt-get source --download-only qemu >/dev/null
        dpkg-source --no-check -x qemu_*.dsc >/dev/null
    fi
    src=$(ls -d "$out"/src/qemu-*/ | head -1)
    mkdir -p "$src/build-plugins"
    cd "$src/build-plugins"
    if [ ! -f build.ninja ]; then
        ../configure --target-list=x86_64-softmmu --enable-plugins --disable-docs \
            --disable-werror --disable-user --disable-gtk --disable-sdl --disable-vnc \
            --disable-opengl --disable-spice --disable-curses --disable-xen \
            --disable-capstone --disable-tools --disable-guest-agent \
            --disable-slirp >/dev/null
    fi
    nice -n 19 ninja -j"$(nproc)" qemu-system-x86_64
    cp qemu-system-x86_64 "$bin"
fi
# Firmware (`-L images/out/qemu-plugins/pc-bios`): the Debian source package has the
# blobs stripped (dfsg), so link Debian's built copies (seabios, qemu-system-data).
if [ ! -e "$out/pc-bios/bios-256k.bin" ]; then
    rm -rf "$out/pc-bios"
    mkdir -p "$out/pc-bios"
    for d in /usr/share/qemu /usr/share/seabios; do
        for f in "$d"/*; do
            [ -e "$out/pc-bios/$(basename "$f")" ] || ln -s "$f" "$out/pc-bios/"
        done
    done
fi

src=$(ls -d "$out"/src/qemu-*/ | head -1)
if [ ! -f "$plugin" ] || [ "$here/qemu-cache-plugin/pa_cache.c" -nt "$plugin" ]; then
    gcc -O2 -shared -fPIC -Wall -Wextra -Wno-unused-parameter -Werror -I"$src/include/qemu" \
        $(pkg-config --cflags glib-2.0) \
        -o "$plugin" "$here/qemu-cache-plugin/pa_cache.c"
fi
bb=$out/plugins/libbb.so
if [ ! -f "$bb" ]; then
    gcc -O2 -shared -fPIC -I"$src/include/qemu" $(pkg-config --cflags glib-2.0) \
        -o "$bb" "$src/tests/plugin/bb.c"
fi
echo "$bin"
echo "$plugin"
echo "$bb"
