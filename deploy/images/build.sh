#!/usr/bin/env bash
# Build kvfabric's images with podman from Debian's packages alone (no registry needed):
#   deploy/images/build.sh [--rebuild-base] [kvfabric] [postgres] [prometheus]   (default: all)
#     kvfabric   -> localhost/kvfabric:<version> (and :latest): every service, the CLI, models
#     postgres   -> localhost/kvfabric-postgres:<version>: billing's ledger (compose)
#     prometheus -> localhost/kvfabric-prometheus:<version>: Debian's Prometheus (compose)
# 1. a bookworm base (python3, gcc, this machine's CA certificates) made with mmdebstrap and
#    imported into podman as localhost/kvfabric-base:bookworm (once; --rebuild-base again);
# 2. each Containerfile on top of it, from a build context of the tracked files (and, for
#    kvfabric, the CPU torch wheel found in $PIP_FIND_LINKS, /opt/wheels here).
# Needs root, podman, runc and mmdebstrap (apt-get install -y podman runc mmdebstrap).
set -euo pipefail
cd "$(dirname "$0")/../.."
here=deploy/images
export CONTAINERS_CONF="${CONTAINERS_CONF:-$PWD/$here/containers.conf}"
version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
base=localhost/kvfabric-base:bookworm
image=localhost/kvfabric:$version
say() { printf '%s %s\n' "$(date +%T)" "$*"; }

for tool in podman runc mmdebstrap; do
  command -v "$tool" >/dev/null || { echo "build.sh: $tool not found (apt-get install -y podman runc mmdebstrap)" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

rebuild_base=0
images=()
for arg in "$@"; do
  case "$arg" in
    --rebuild-base) rebuild_base=1 ;;
    kvfabric | postgres | prometheus) images+=("$arg") ;;
    *) echo "build.sh: unknown argument $arg (--rebuild-base, kvfabric, postgres, prometheus)" >&2; exit 2 ;;
  esac
done
[[ ${#images[@]} -gt 0 ]] || images=(kvfabric postgres prometheus)

if [[ $rebuild_base == 1 ]] || ! podman image exists "$base"; then
  say "base: mmdebstrap bookworm (python3, gcc) ..."
  mmdebstrap --quiet --variant=minbase \
    --include=ca-certificates,python3,python3-venv,gcc,libc6-dev \
    --customize-hook='copy-in /usr/local/share/ca-certificates /usr/local/share' \
    --customize-hook='chroot "$1" update-ca-certificates' \
    bookworm "$work/rootfs.tar" \
    "deb http://deb.debian.org/debian bookworm main" \
    "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main"
  podman import --quiet --change 'CMD ["/bin/bash"]' "$work/rootfs.tar" "$base" >/dev/null
  say "base: $base ($(podman image inspect --format '{{.Size}}' "$base") bytes)"
fi

say "context: the tracked files"
mkdir -p "$work/context/wheels"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$work/context"

for name in "${images[@]}"; do
  case "$name" in
    kvfabric)
      wheel=$(ls "${PIP_FIND_LINKS:-/opt/wheels}"/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1 || true)
      if [[ -z "$wheel" ]]; then
        echo "build.sh: no torch-2.13.0+cpu cp311 wheel in ${PIP_FIND_LINKS:-/opt/wheels}" >&2
        exit 1
      fi
      cp "$wheel" "$work/context/wheels/"
      tags=(-t "$image" -t localhost/kvfabric:latest)
      file=Containerfile.cpu ;;
    *)
      tags=(-t "localhost/kvfabric-$name:$version")
      file=Containerfile.$name ;;
  esac
  say "image: ${tags[1]} ..."
  podman build --quiet -f "$work/context/$here/$file" "${tags[@]}" "$work/context" >/dev/null
  say "image: ${tags[1]} ($(podman image inspect --format '{{.Size}}' "${tags[1]}") bytes)"
done
