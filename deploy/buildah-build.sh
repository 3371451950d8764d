#!/usr/bin/env bash
# Builds one of deploy/'s Dockerfiles with buildah, where there is no Docker engine and no Docker Hub (make image,
# make reconcile-image, tests/deploy/test_image.py):
#   deploy/buildah-build.sh deploy/Dockerfile cdc:latest
# Their default base, python:3.11-slim, is Debian bookworm with Python 3.11; the stand-in is made here from
# Debian's own packages (mmdebstrap: bookworm, minbase, python3 3.11, python3-venv, ca-certificates), kept as a
# tarball in a cache keyed on that recipe (CDC_IMAGE_CACHE, default ~/.cache/cdc/image) and imported once into
# buildah's storage as localhost/cdc-base:bookworm-<key>. The build keeps its layers (--layers), so building
# again after no change, or a change under cdc/ only, reuses what it can.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 DOCKERFILE TAG" >&2; exit 2; }
dockerfile=$1 tag=$2
root=$(cd "$(dirname "$0")/.." && pwd)
for tool in buildah mmdebstrap; do
    command -v "$tool" >/dev/null || { echo "$0: $tool is not installed: run make image-deps (apt-get install buildah mmdebstrap)" >&2; exit 3; }
done
cache=${CDC_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cdc/image}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

# the base: its recipe, and the key of the recipe (a change of it makes a new base; the mirrors are not in it)
suite=bookworm
packages=python3,python3-venv,ca-certificates
recipe="suite=$suite variant=minbase include=$packages updates=yes security=yes lang=C.UTF-8 nodocs=yes"
key=$(printf '%s' "$recipe" | sha256sum | cut -c1-12)
base=localhost/cdc-base:$suite-$key
if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
    tarball=$cache/base-$suite-$key.tar
    if [ ! -s "$tarball" ]; then
        mkdir -p "$cache"
        echo "$0: making the base ($recipe) with mmdebstrap into $tarball"
        mmdebstrap --quiet --variant=minbase --include="$packages" \
            --aptopt='Acquire::Languages "none"' \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
            "$suite" "$tarball.part" \
            "deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security $suite-security main" \
            </dev/null
        mv "$tarball.part" "$tarball"
    fi
    echo "$0: importing $tarball as $base"
    container=$(buildah from scratch)
    trap 'buildah rm "$container" >/dev/null 2>&1 || true' EXIT
    buildah add --quiet "$container" "$tarball" / >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
        --cmd python3 --label "cdc.base.recipe=$recipe" "$container"
    buildah commit --quiet --rm "$container" "$base" >/dev/null
    trap - EXIT
fi

# pip inside the build trusts the CA bundle this machine's pip trusts (PIP_CERT, else the system's: a network that
# inspects TLS has its CA there), through a pip.conf mounted for the build's RUN steps only, never in the image
ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
mounts=()
if [ -s "$ca" ]; then
    mkdir -p "$cache"
    printf '[global]\ncert = /run/cdc-build/ca.crt\n' > "$cache/pip.conf"
    mounts=(--volume "$ca:/run/cdc-build/ca.crt:ro" --volume "$cache/pip.conf:/etc/pip.conf:ro")
fi

echo "$0: building $dockerfile as $tag on $base"
exec buildah build "${mounts[@]}" --isolation chroot --layers --format docker --quiet \
    --build-arg "BASE=$base" --build-arg "BUILD_PACKAGES=gcc libc6-dev python3-dev" \
    -f "$root/$dockerfile" -t "$tag" "$root"
