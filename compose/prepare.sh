#!/usr/bin/env bash
# The secrets compose.yaml mounts, made once under compose/secrets/ (kept; not in git):
#   nats/<role>.nk and nats/authorization.conf  (`kvfabric nats-creds`, run in the image)
#   postgres.env  the ledger's password          ingress.env  a dev API key for a first request
# Usage: compose/prepare.sh [IMAGE]   (default localhost/kvfabric:<version>)
set -euo pipefail
cd "$(dirname "$0")"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$PWD/../deploy/images/containers.conf}"
version=$(python3 -c 'import tomllib; print(tomllib.load(open("../pyproject.toml", "rb"))["project"]["version"])')
image=${1:-localhost/kvfabric:$version}
mkdir -p -m 0700 secrets
if [[ ! -f secrets/nats/authorization.conf ]]; then
  podman run --rm -v "$PWD/secrets:/secrets" "$image" nats-creds /secrets/nats >/dev/null
  echo "secrets/nats: a seed per role and authorization.conf"
fi
if [[ ! -f secrets/postgres.env ]]; then
  password=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
  # The server's first start reads POSTGRES_PASSWORD; billing's client reads PGPASSWORD.
  (umask 077; printf 'POSTGRES_PASSWORD=%s\nPGPASSWORD=%s\n' "$password" "$password" > secrets/postgres.env)
  echo "secrets/postgres.env: the ledger's password"
fi
if [[ ! -f secrets/ingress.env ]]; then
  key=kvf-dev-$(python3 -c 'import secrets; print(secrets.token_hex(16))')
  (umask 077; printf 'KVF_INGRESS_DEV_API_KEY=%s\n' "$key" > secrets/ingress.env)
  echo "secrets/ingress.env: a dev API key (account dev) for a first request"
fi
