#!/usr/bin/env bash
# Build Sluice's image here, where no registry image can be pulled:
#
#   bash infra/docker/image.sh            # -> $SLUICE_IMAGE (default sluice:local)
#
# The host's pip fetches every locked wheel (its indexes; the image has none), the
# tracked files of this checkout are the project, and infra/docker/Dockerfile.local
# installs both into a venv on the local base image (infra/docker/engine.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
image=${SLUICE_IMAGE:-sluice:local}
bash infra/docker/engine.sh
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
# The image's python is Debian's 3.11.2: async-timeout is a dependency there (a marker
# on python_full_version) that the host's newer 3.11 does not download.
pip download -q -c requirements.lock -d "$context/wheelhouse" . \
  "setuptools>=68" wheel "async-timeout>=4.0.3"
mkdir "$context/project"
git ls-files -z | xargs -0 tar -c | tar -x -C "$context/project"
cp infra/docker/Dockerfile.local "$context/Dockerfile"
DOCKER_BUILDKIT=0 docker build -q -t "$image" "$context" >/dev/null
echo "image.sh: built $image"
