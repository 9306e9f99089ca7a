#!/usr/bin/env bash
# A Docker engine on a Debian host that has none (a CI machine, a fresh VM), as root; does nothing where `docker
# info` already answers. Debian's docker.io, with compose v2 and buildx taken from Debian trixie's packages
# (bookworm has neither), and dockerd started by hand (for hosts with no init system). About 30 s.
#   infra/docker/engine.sh            # then: docker compose version
set -euo pipefail

if docker info >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "engine.sh: no Docker engine answers, and starting one needs root on a Debian host" >&2
    exit 77  # cannot be done here (any other failure is one)
fi
export DEBIAN_FRONTEND=noninteractive

if ! command -v dockerd >/dev/null; then
    apt-get install -y -q --no-install-recommends docker.io >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends docker.io >/dev/null; }
fi

plugins=/usr/local/lib/docker/cli-plugins
if ! docker compose version >/dev/null 2>&1 || ! docker buildx version >/dev/null 2>&1; then
    # trixie's index in a private apt state: the host's own sources and package lists stay as they are
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1 || true)
    mirror=${mirror:-http://deb.debian.org/debian}
    mkdir -p "$work/lists/partial" "$work/archives/partial" "$work/parts"
    printf 'Types: deb\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: %s\n' \
        "$mirror" /usr/share/keyrings/debian-archive-keyring.gpg > "$work/parts/trixie.sources"
    apt_trixie=(-q -o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$work/parts"
                -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::Archives=$work/archives")
    apt-get "${apt_trixie[@]}" update >/dev/null
    (cd "$work" && apt-get "${apt_trixie[@]}" download docker-compose docker-buildx >/dev/null)
    for deb in "$work"/*.deb; do
        dpkg-deb -x "$deb" "$work/root"
    done
    mkdir -p "$plugins"
    cp "$work"/root/usr/libexec/docker/cli-plugins/docker-* "$plugins/"
fi

if ! pgrep -x dockerd >/dev/null; then
    # its own session, out of the caller's (a test run's TMPDIR is deleted when the run ends; dockerd outlives it)
    env -u TMPDIR setsid nohup dockerd >/var/log/dockerd.log 2>&1 < /dev/null &
fi
for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && exit 0
    sleep 0.5
done
echo "engine.sh: dockerd did not answer within 60 s; see /var/log/dockerd.log" >&2
exit 1
