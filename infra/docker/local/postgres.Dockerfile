# tokenfleet-postgres:bookworm (local-images.sh): Debian's PostgreSQL 15, initialised on first start from
# POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB into /var/lib/postgresql/data, as the official image is.
FROM tokenfleet-rootfs:bookworm
RUN apt-get update -q && apt-get install -y -q --no-install-recommends postgresql-15 >/dev/null \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
    && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/
USER postgres
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["postgres-entrypoint.sh"]
