#!/usr/bin/env bash
# Build Sluice's images here, where no registry image can be pulled:
#
#   bash infra/docker/image.sh        # -> $SLUICE_IMAGE (default sluice:local)
#   bash infra/docker/image.sh s3     # -> sluice-s3:local, moto's S3 server for MinIO
#
# sluice:local is two images, each labelled with a digest of what went into it and
# built only when that digest changes:
#   - sluice-deps:local (infra/docker/Dockerfile.deps): every locked wheel in a venv on
#     the local base image (infra/docker/engine.sh). Its digest covers requirements.lock,
#     the project's dependency list, that Dockerfile and the slimming script: minutes to
#     build, and only when the dependencies change.
#   - sluice:local (infra/docker/Dockerfile.local) on top of it: the files of this
#     working tree that git tracks or would track (not ignored; without tests/ and
#     docs/), src/sluice's links to the top-level folders included, installed without
#     dependencies. Its digest covers every file's bytes and every link's target: seconds
#     to build, after any source edit.
# The host's pip fetches every locked wheel (its indexes; the image has none), builds
# one where only a source archive exists (pycosat, which reasoning-gym needs: C, and
# the base has no compiler; the host must be as old a glibc as the base, Debian 12),
# and serves them to the build over the host's loopback, so they never become a layer.
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
# The extras the containers use: Ray nodes (cluster), a split trainer's ranks on them
# (megatron) and the Docker work pool's worker (docker).
IMAGE_EXTRAS=cluster,megatron,docker
# The project's dependency list as pyproject.toml declares it, with its extras (its other
# tables, pytest's settings say, change nothing the dependency image holds).
dependency_list() {
  python3 -c 'import json, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(json.dumps([p["dependencies"], p.get("optional-dependencies"), p.get("requires-python")]))'
  echo "$IMAGE_EXTRAS"
}
# Serve a wheelhouse on the host's loopback and build `$1` from context `$2` with the
# build args that follow; the wheels reach the build as a URL, never as a layer.
build_with_wheels() {
  local dockerfile=$1 files=$2 wheelhouse=$3
  shift 3
  local port server
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python3 -m http.server "$port" --bind 127.0.0.1 --directory "$wheelhouse" >/dev/null 2>&1 &
  server=$!
  DOCKER_BUILDKIT=0 docker build -q --force-rm --network host "$@" \
    --build-arg "WHEELS=http://127.0.0.1:$port/" -f "$dockerfile" "$files" 2>&1 \
    | { grep -v "DEPRECATED\|BuildKit\|environment-variable\|^sha256:" || true; }
  kill "$server" 2>/dev/null || true
}
label_of() {
  docker image inspect -f "{{ index .Config.Labels \"$2\" }}" "$1" 2>/dev/null || true
}
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT

case "$target" in
  sluice)
    image=${SLUICE_IMAGE:-sluice:local}
    deps_image=sluice-deps:local
    deps=$({ sha256sum infra/docker/Dockerfile.deps infra/docker/slim-site-packages.sh \
      requirements.lock; dependency_list; } | sha256sum | cut -c1-16)
    if [ "$(label_of "$deps_image" sluice.deps)" = "$deps" ]; then
      echo "image.sh: $deps_image is up to date ($deps)"
    else
      # The image's python is Debian's 3.11.2: async-timeout is a dependency there (a
      # marker on python_full_version) that the host's newer 3.11 does not download.
      pip wheel -q -c requirements.lock -w "$context/wheelhouse" ".[$IMAGE_EXTRAS]" "setuptools>=68" wheel \
        "async-timeout>=4.0.3" 2>&1 | { grep -v "^WARNING: Location" || true; }
      mkdir "$context/deps"
      cp infra/docker/slim-site-packages.sh "$context/deps/"
      build_with_wheels infra/docker/Dockerfile.deps "$context/deps" "$context/wheelhouse" \
        --build-arg "DEPS=$deps" --build-arg "EXTRAS=$IMAGE_EXTRAS" -t "$deps_image"
      echo "image.sh: built $deps_image ($deps)"
    fi
    # Markdown is left out of the digest: a README edit changes nothing the image runs.
    digest=$({ project_files | grep -zv '\.md$' | tree_digest; sha256sum infra/docker/Dockerfile.local
      echo "$deps"; } | sha256sum | cut -c1-16)
    if [ "$(label_of "$image" sluice.source)" = "$digest" ]; then
      echo "image.sh: $image is up to date ($digest)"
      exit 0
    fi
    mkdir "$context/files"
    project_files | tar -c --null --no-recursion -T - -f - | tar -x -C "$context/files"
    DOCKER_BUILDKIT=0 docker build -q --force-rm --network none --build-arg "SOURCE=$digest" \
      --build-arg "DEPS_IMAGE=$deps_image" -t "$image" -f infra/docker/Dockerfile.local \
      "$context/files" 2>&1 | { grep -v "DEPRECATED\|BuildKit\|environment-variable\|^sha256:" || true; }
    ;;
  s3)
    image=sluice-s3:local
    dockerfile=infra/docker/Dockerfile.s3-local
    digest=$({ sha256sum "$dockerfile" infra/docker/s3-local/*; grep '^moto==' requirements.lock; } \
      | sha256sum | cut -c1-16)
    if [ "$(label_of "$image" sluice.source)" = "$digest" ]; then
      echo "image.sh: $image is up to date ($digest)"
      exit 0
    fi
    pip wheel -q -c requirements.lock -w "$context/wheelhouse" "moto[server]" 2>&1 \
      | { grep -v "^WARNING: Location" || true; }
    mkdir "$context/files"
    cp -r infra/docker/s3-local "$context/files/"
    build_with_wheels "$dockerfile" "$context/files" "$context/wheelhouse" \
      --build-arg "SOURCE=$digest" -t "$image"
    ;;
  *)
    echo "image.sh: unknown image '$target' (sluice or s3)" >&2
    exit 2
    ;;
esac
# Earlier builds of the images hold no tag now; their layers go with them.
docker image prune -f >/dev/null
echo "image.sh: built $image ($digest)"
