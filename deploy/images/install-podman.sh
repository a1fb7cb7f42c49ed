#!/usr/bin/env bash
# podman, runc and mmdebstrap from Debian where missing (as root, with apt-get): what
# build.sh and compose/ need. The settings this kind of machine needs are in containers.conf
# beside this script (CONTAINERS_CONF points podman at it).
set -euo pipefail
missing=()
for tool in podman runc mmdebstrap; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
  echo "install-podman.sh: ${missing[*]} missing; install them as root (apt-get install -y podman runc mmdebstrap)" >&2
  exit 1
fi
echo "installing ${missing[*]} from Debian"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap >/dev/null
