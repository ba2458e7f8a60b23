#!/usr/bin/env bash
# Build Sluice's image here, where no registry image can be pulled:
#
#   bash infra/docker/image.sh            # -> $SLUICE_IMAGE (default sluice:local)
#
# The host's pip fetches every locked wheel (its indexes; the image has none), the
# tracked files of this checkout (without tests/ and docs/) are the project, and
# infra/docker/Dockerfile.local installs both into a venv on the local base image
# (infra/docker/engine.sh). The image is labelled with a digest of those files; when
# the image already carries this checkout's digest, nothing is built.
set -euo pipefail
cd "$(dirname "$0")/../.."
image=${SLUICE_IMAGE:-sluice:local}
bash infra/docker/engine.sh
project_files() { git ls-files -z -- . ':!tests' ':!docs'; }
# Markdown is left out of the digest: a README edit changes nothing the image runs.
digest=$( (project_files | grep -zv '\.md$' | xargs -0 sha256sum; \
  sha256sum infra/docker/Dockerfile.local) | sha256sum | cut -c1-16)
built=$(docker image inspect -f '{{ index .Config.Labels "sluice.source" }}' "$image" 2>/dev/null || true)
if [ "$built" = "$digest" ]; then
  echo "image.sh: $image is up to date ($digest)"
  exit 0
fi
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
# The image's python is Debian's 3.11.2: async-timeout is a dependency there (a marker
# on python_full_version) that the host's newer 3.11 does not download.
pip download -q -c requirements.lock -d "$context/wheelhouse" . \
  "setuptools>=68" wheel "async-timeout>=4.0.3" 2>&1 | { grep -v "^WARNING: Location" || true; }
mkdir "$context/project"
project_files | xargs -0 tar -c | tar -x -C "$context/project"
cp infra/docker/Dockerfile.local "$context/Dockerfile"
# The wheels reach the build over HTTP on the host's loopback, so they are never copied
# into a layer of the image.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$context/wheelhouse" \
  >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$context"' EXIT
DOCKER_BUILDKIT=0 docker build -q --network host --build-arg "SOURCE=$digest" \
  --build-arg "WHEELS=http://127.0.0.1:$port/" -t "$image" \
  -f "$context/Dockerfile" "$context/project" 2>&1 \
  | { grep -v "DEPRECATED\|BuildKit\|environment-variable\|^sha256:" || true; }
# Containers of the image's earlier builds hold no tag; their layers go with them.
docker image prune -f >/dev/null
echo "image.sh: built $image ($digest)"
