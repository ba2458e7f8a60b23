#!/usr/bin/env bash
# Build Sluice's images here, where no registry image can be pulled:
#
#   bash infra/docker/image.sh        # -> $SLUICE_IMAGE (default sluice:local)
#   bash infra/docker/image.sh s3     # -> sluice-s3:local, moto's S3 server for MinIO
#
# The host's pip fetches every locked wheel (its indexes; the image has none), builds
# one where only a source archive exists (pycosat, which reasoning-gym needs: C, and
# the base has no compiler; the host must be as old a glibc as the base, Debian 12),
# and serves them to the build over the host's loopback, so they never become a layer.
# sluice:local is the files of this working tree that git tracks or would track (not
# ignored; without tests/ and docs/), src/sluice's links to the top-level folders
# included, installed by infra/docker/Dockerfile.local into a venv on the local base
# image (infra/docker/engine.sh). Each image is labelled with a digest of what went into
# it (every file's bytes, every link's target); when the image already carries the
# current digest, nothing is built.
set -euo pipefail
cd "$(dirname "$0")/../.."
target=${1:-sluice}
bash infra/docker/engine.sh

# Tracked and untracked-but-not-ignored paths that exist (a new module a test imports
# must reach the image too; a deleted one must not break the copy).
project_files() {
  git ls-files -z --cached --others --exclude-standard -- . ':!tests' ':!docs' \
    | while IFS= read -r -d '' path; do
        if [ -e "$path" ] || [ -L "$path" ]; then printf '%s\0' "$path"; fi
      done
}
# The bytes of files and the targets of links (sha256sum would follow a link to a folder).
tree_digest() {
  LC_ALL=C sort -z | tar -c --null --no-recursion -T - --mtime=@0 --owner=0 --group=0 \
    --numeric-owner -f - | sha256sum
}
case "$target" in
  sluice)
    image=${SLUICE_IMAGE:-sluice:local}
    dockerfile=infra/docker/Dockerfile.local
    # The image's python is Debian's 3.11.2: async-timeout is a dependency there (a
    # marker on python_full_version) that the host's newer 3.11 does not download.
    wheels=(. "setuptools>=68" wheel "async-timeout>=4.0.3")
    # Markdown is left out of the digest: a README edit changes nothing the image runs.
    digest_of() { project_files | grep -zv '\.md$' | tree_digest; sha256sum "$dockerfile"; }
    ;;
  s3)
    image=sluice-s3:local
    dockerfile=infra/docker/Dockerfile.s3-local
    wheels=("moto[server]")
    digest_of() { sha256sum "$dockerfile" infra/docker/s3-local/*; grep '^moto==' requirements.lock; }
    ;;
  *)
    echo "image.sh: unknown image '$target' (sluice or s3)" >&2
    exit 2
    ;;
esac
digest=$(digest_of | sha256sum | cut -c1-16)
built=$(docker image inspect -f '{{ index .Config.Labels "sluice.source" }}' "$image" 2>/dev/null || true)
if [ "$built" = "$digest" ]; then
  echo "image.sh: $image is up to date ($digest)"
  exit 0
fi

context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
pip wheel -q -c requirements.lock -w "$context/wheelhouse" "${wheels[@]}" 2>&1 \
  | { grep -v "^WARNING: Location" || true; }
mkdir "$context/files"
if [ "$target" = sluice ]; then
  project_files | tar -c --null --no-recursion -T - -f - | tar -x -C "$context/files"
else
  cp -r infra/docker/s3-local "$context/files/"
fi
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$context/wheelhouse" \
  >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$context"' EXIT
DOCKER_BUILDKIT=0 docker build -q --force-rm --network host --build-arg "SOURCE=$digest" \
  --build-arg "WHEELS=http://127.0.0.1:$port/" -t "$image" -f "$dockerfile" "$context/files" 2>&1 \
  | { grep -v "DEPRECATED\|BuildKit\|environment-variable\|^sha256:" || true; }
# Earlier builds of the image hold no tag now; their layers go with them.
docker image prune -f >/dev/null
echo "image.sh: built $image ($digest)"
