#!/bin/sh
# The official postgres image's first start, in short: a cluster owned by POSTGRES_USER with its password
# (scram-sha-256 over TCP, trust on the local socket inside the container), and the database POSTGRES_DB.
set -eu
user=${POSTGRES_USER:-postgres}
database=${POSTGRES_DB:-$user}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
    password_file=$(mktemp)
    printf '%s' "$POSTGRES_PASSWORD" > "$password_file"
    initdb --username="$user" --pwfile="$password_file" --auth-local=trust --auth-host=scram-sha-256 \
        --encoding=UTF8 >/dev/null
    rm -f "$password_file"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    pg_ctl -w -o "-c listen_addresses=''" start >/dev/null
    if [ "$database" != postgres ]; then
        createdb --username="$user" "$database"
    fi
    pg_ctl -w -m fast stop >/dev/null
fi
exec postgres -c listen_addresses='*' "$@"
