#!/usr/bin/env bash
# A local Docker engine and Sluice's base image, where no registry image can be pulled.
#
#   bash infra/docker/engine.sh
#
# 1. If no engine answers `docker info`, install docker.io and debootstrap (apt, as
#    root) if missing and start dockerd without iptables or a bridge (containers use
#    --network none or host). Its storage driver is overlay2 where the kernel mounts an
#    overlay on the engine's data folder (a probe mount says), else vfs, which needs no
#    kernel support but copies the whole image for every container and build step
#    ($SLUICE_DOCKER_STORAGE_DRIVER names one instead).
# 2. If the base image ($SLUICE_BASE_IMAGE, default sluice-base:bookworm) is missing,
#    build it: a minimal Debian bookworm with python3 and python3-venv from the mirror
#    apt already uses (debootstrap, about a minute), imported as an image.
# 3. Install docker-compose (apt) if missing, for the compose stack's test.
# Exits 0 with the engine reachable and the image present, else non-zero with one line.
set -euo pipefail
image=${SLUICE_BASE_IMAGE:-sluice-base:bookworm}

fail() { echo "engine.sh: $*" >&2; exit 1; }

# overlay2 if an overlay mounts where the engine keeps its layers, else vfs. (dockerd
# told overlay2 on a file system that cannot carry it refuses to start.)
storage_driver() {
  local root=/var/lib/docker probe
  mkdir -p "$root"
  probe=$(mktemp -d "$root/.overlay-probe.XXXXXX") || { echo vfs; return; }
  mkdir "$probe/lower" "$probe/upper" "$probe/work" "$probe/merged"
  if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" \
      "$probe/merged" 2>/dev/null; then
    umount "$probe/merged"
    echo overlay2
  else
    echo vfs
  fi
  rm -rf "$probe"
}

if ! docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || fail "no Docker engine answers and starting one needs root"
  if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq docker.io debootstrap >/dev/null || fail "apt could not install docker.io"
  fi
  driver=${SLUICE_DOCKER_STORAGE_DRIVER:-$(storage_driver)}
  nohup dockerd --iptables=false --bridge=none --storage-driver="$driver" \
    >"${TMPDIR:-/tmp}/sluice-dockerd.log" 2>&1 &
  # A fresh machine's first start sets up the engine's state: give it two minutes.
  for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || fail "dockerd ($driver storage driver) did not answer in 120 s (see ${TMPDIR:-/tmp}/sluice-dockerd.log)"
fi

# Compose for the stack's test (tests/integration/test_compose_stack.py): Debian's is
# Compose v1, which reads infra/docker/compose.yaml as it is.
if ! command -v docker-compose >/dev/null && [ "$(id -u)" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive \
         apt-get install -y -qq docker-compose >/dev/null 2>&1; } \
    || echo "engine.sh: apt could not install docker-compose; the compose test will skip" >&2
fi

docker image inspect "$image" >/dev/null 2>&1 && exit 0
command -v debootstrap >/dev/null || fail "the base image is missing and debootstrap is not installed"
# The Debian mirror apt uses here (deb822 sources first, then sources.list).
mirror=$(grep -hoE '^URIs: *http[^ ]*debian/?$' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | sed 's/^URIs: *//')
[ -n "$mirror" ] || mirror=$(grep -hoE '^deb +http[^ ]*debian/? ' /etc/apt/sources.list 2>/dev/null | head -1 | awk '{print $2}')
mirror=${mirror:-http://deb.debian.org/debian}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root" "$mirror" >/dev/null \
  || fail "debootstrap from $mirror failed"
# Package caches, documentation and translations: half the tree, and the vfs storage
# driver copies the whole image for every container the code sandbox starts.
rm -rf "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* \
  "$root"/usr/share/doc/* "$root"/usr/share/locale/* "$root"/usr/share/man/* "$root"/usr/share/info/*
chmod 755 "$root"  # mktemp made it 0700: the image's / would shut out non-root users
tar -C "$root" -c . | docker import - "$image" >/dev/null
echo "engine.sh: built $image from $mirror"
