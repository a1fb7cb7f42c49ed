#!/bin/sh
# First start: a cluster in $PGDATA whose superuser `kvfabric` logs in with $POSTGRES_PASSWORD
# over the network, and the `kvfabric` database the ledger migrates. Every start: postgres
# itself as PID 1, as the postgres user (SIGTERM is its "smart" shutdown).
set -eu
bin=/usr/lib/postgresql/15/bin
mkdir -p "$PGDATA"
chown postgres:postgres "$PGDATA"
chmod 700 "$PGDATA"
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "postgres-entrypoint: POSTGRES_PASSWORD is empty; refusing to make a cluster without one" >&2
    exit 1
  fi
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  chown postgres "$pwfile"
  as_postgres "$bin/initdb" --pgdata="$PGDATA" --username=kvfabric --pwfile="$pwfile" \
    --auth-local=peer --auth-host=scram-sha-256 --encoding=UTF8 >/dev/null
  rm -f "$pwfile"
  echo "host all all 0.0.0.0/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
  echo "CREATE DATABASE kvfabric;" | as_postgres "$bin/postgres" --single -D "$PGDATA" postgres >/dev/null
  echo "postgres-entrypoint: made the cluster in $PGDATA"
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups \
  "$bin/postgres" -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/tmp
