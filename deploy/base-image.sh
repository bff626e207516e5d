#!/bin/sh
# Builds a local Debian base image with debootstrap and `docker import`, for
# hosts that cannot pull from a container registry but reach a Debian mirror.
#
#   deploy/base-image.sh [--force] [TAG]        (default TAG: pdserve/debian:bookworm)
#
# Then build with it:
#   docker compose -f deploy/docker-compose.yml build \
#       --build-arg BASE_IMAGE=pdserve/debian:bookworm --build-arg BUILD_IMAGE=pdserve/debian:bookworm
# or put PDSERVE_BASE_IMAGE=pdserve/debian:bookworm in deploy/.env (see docs/deploy.md).
#
# Environment: SUITE (bookworm), MIRROR (the host's Debian mirror from its apt
# sources, else http://deb.debian.org/debian), SECURITY_MIRROR (likewise for
# debian-security), VARIANT (minbase), CACHE_DIR (where the rootfs is made:
# .cache/ of the checkout), HOST_CA (1: copy this host's
# /usr/local/share/ca-certificates into the image; 0: don't). Needs root, debootstrap and a running Docker engine.
# An image that already exists is kept (exit 0) unless --force is given.
set -eu

FORCE=0
if [ "${1:-}" = "--force" ]; then FORCE=1; shift; fi
TAG="${1:-pdserve/debian:bookworm}"
SUITE="${SUITE:-bookworm}"
VARIANT="${VARIANT:-minbase}"
ROOT_DIR="$(cd "$(dirname "$0")/.." && pwd)"
CACHE_DIR="${CACHE_DIR:-$ROOT_DIR/.cache}"

if [ "$FORCE" = 0 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base-image: $TAG already exists (--force rebuilds it)"
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "base-image: debootstrap needs root" >&2
    exit 1
fi
if ! command -v debootstrap >/dev/null 2>&1; then
    echo "base-image: installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap >/dev/null
fi

# The mirror this host already uses (deb822 .sources or one-line .list files).
host_mirror() { # $1: debian or debian-security
    for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -r "$f" ] || continue
        sed -n -e 's/^URIs:[[:space:]]*//p' -e 's/^deb[[:space:]]\{1,\}\(\[[^]]*\][[:space:]]\{1,\}\)\{0,1\}\([^[:space:]]*\).*/\2/p' "$f"
    done | tr ' ' '\n' | grep -E "/$1/?\$" | head -n 1 | sed 's:/$::'
}
MIRROR="${MIRROR:-$(host_mirror debian)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${SECURITY_MIRROR:-$(host_mirror debian-security)}"
SECURITY_MIRROR="${SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

mkdir -p "$CACHE_DIR"
WORK=$(mktemp -d "$CACHE_DIR/rootfs.XXXXXX")
trap 'rm -rf "$WORK"' EXIT INT TERM
ROOTFS="$WORK/rootfs"

echo "base-image: debootstrap --variant=$VARIANT $SUITE from $MIRROR"
start=$(date +%s)
if ! debootstrap --variant="$VARIANT" --include=ca-certificates "$SUITE" "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1; then
    tail -n 30 "$WORK/debootstrap.log" >&2
    [ -f "$ROOTFS/debootstrap/debootstrap.log" ] && tail -n 30 "$ROOTFS/debootstrap/debootstrap.log" >&2
    echo "base-image: debootstrap failed" >&2
    exit 1
fi

# What the official debian image configures: the full suite set, no
# recommends, no caches or translations kept in layers.
rm -f "$ROOTFS/etc/apt/sources.list"
cat >"$ROOTFS/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY_MIRROR
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
cat >"$ROOTFS/etc/apt/apt.conf.d/90pdserve-container" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
Acquire::GzipIndexes "true";
Acquire::CompressionTypes::Order:: "gz";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/90pdserve-container" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
# dpkg without fsync inside image builds (as the official image does)
echo force-unsafe-io >"$ROOTFS/etc/dpkg/dpkg.cfg.d/90pdserve-unsafe-io"
# The certificate authorities this host added locally (an egress proxy's, a
# company's): an image made for this host trusts what the host trusts, so
# that apt over https and npm work in builds. HOST_CA=0 leaves them out.
if [ "${HOST_CA:-1}" != 0 ] && ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    mkdir -p "$ROOTFS/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
    chroot "$ROOTFS" update-ca-certificates >/dev/null 2>&1 || {
        echo "base-image: update-ca-certificates failed in the rootfs" >&2
        exit 1
    }
    echo "base-image: added this host's local CA certificates: $(cd /usr/local/share/ca-certificates && echo *.crt)"
fi
# services must not start inside image builds
printf '#!/bin/sh\nexit 101\n' >"$ROOTFS/usr/sbin/policy-rc.d"
chmod 755 "$ROOTFS/usr/sbin/policy-rc.d"
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb \
    "$ROOTFS"/var/log/*.log "$ROOTFS"/tmp/* "$ROOTFS"/usr/share/doc/*/changelog* "$ROOTFS"/usr/share/man/*
: >"$ROOTFS/etc/machine-id"
echo "$SUITE" >"$ROOTFS/etc/hostname"

tar --numeric-owner --xattrs -C "$ROOTFS" -c . |
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["bash"]' \
        --message "debootstrap --variant=$VARIANT $SUITE $MIRROR" \
        - "$TAG" >/dev/null
echo "base-image: $TAG ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'), $(($(date +%s) - start)) s)"
