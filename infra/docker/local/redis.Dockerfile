# tokenfleet-redis:bookworm (local-images.sh): Debian's redis-server, as the official image runs it: no config
# file (Redis's defaults), protected mode off (the official image builds it off: a container is reached from
# outside its own loopback), data in /data, as the redis user.
FROM tokenfleet-rootfs:bookworm
RUN apt-get update -q && apt-get install -y -q --no-install-recommends redis-server >/dev/null \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data \
    && printf '#!/bin/sh\nexec /usr/bin/redis-server "$@" --protected-mode no\n' > /usr/local/bin/redis-server \
    && chmod +x /usr/local/bin/redis-server
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]
