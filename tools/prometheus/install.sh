#!/bin/bash
# Installs Prometheus 2.42 — promtool, which checks and unit-tests kvgate's alert rules, and
# the server — from Debian's `prometheus` package, unpacked into DIR, not installed on the
# system: `install.sh DIR` (`cargo xtask test` passes target/prometheus). The binaries land in
# DIR/usr/bin; they need only libc. The server's web UI assets (other Debian packages) are not
# unpacked: its HTTP API is all there is.
#
# The package's version is pinned in `version` beside this script. DIR is marked installed
# (.kvgate-installed, a copy of that file) only when both binaries ran; a half-made DIR is
# made again next time.
set -euo pipefail
D=${1:?usage: install.sh DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
VERSION=$(cat "$HERE/version")
DEB=$(mktemp -d)
trap 'rm -rf "$DEB"' EXIT
# Downloaded as whoever runs this (as root apt would hand the download to its own user, who
# cannot write to this private directory); apt checks the file against its signed lists.
fetch() { (cd "$DEB" && apt-get download -q -o APT::Sandbox::User="$(id -un)" "prometheus=$VERSION"); }
# A machine whose package lists were never fetched (or are stale) knows no such version yet.
fetch || { apt-get update -q && fetch; }
rm -rf "$D"
mkdir -p "$D"
dpkg-deb -x "$DEB"/prometheus_*.deb "$D"
"$D/usr/bin/promtool" --version
"$D/usr/bin/prometheus" --version
cp "$HERE/version" "$D/.kvgate-installed"
