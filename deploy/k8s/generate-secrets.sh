#!/bin/sh
# Makes what the kustomize secretGenerators read, kept if already there (re-running it
# changes nothing; delete a file to rotate it). Nothing it writes is committed
# (deploy/k8s/.gitignore). Needs `kvfabric` on PATH (the project's venv).
#   deploy/k8s/generate-secrets.sh [ROOT]     # ROOT: the subject root, KVF_ROOT (kvf.v1)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=${1:-kvf.v1}
umask 077

# One nkey seed per NATS role and the `authorization` block naming their public keys, which
# the NATS servers include (the permissions are templated on ROOT: it must be KVF_ROOT).
kvfabric nats-creds "$here/base/secrets/nats" --root "$root" >/dev/null

# The ledger's database: the password, and billing's KVF_BILLING_LEDGER_URL built from it
# (the URL is the config value, so the Secret carries it whole).
if [ ! -f "$here/base/secrets/postgres.env" ]; then
    password=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
    printf 'password=%s\nledger-url=postgresql://kvfabric:%s@postgres:5432/kvfabric\n' \
        "$password" "$password" >"$here/base/secrets/postgres.env"
fi

# cpu-dev's dev API key (billed to account `dev`); the gpu overlay has none: its keys are
# made against the running cluster with `kvfabric keys create`.
mkdir -p "$here/overlays/cpu-dev/secrets"
if [ ! -f "$here/overlays/cpu-dev/secrets/dev-api-key" ]; then
    python3 -c 'import secrets; print("kvf-dev-" + secrets.token_hex(16), end="")' \
        >"$here/overlays/cpu-dev/secrets/dev-api-key"
fi
echo "secrets under $here/base/secrets and $here/overlays/cpu-dev/secrets"
