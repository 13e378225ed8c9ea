#!/usr/bin/env bash
# Wheels a GPU machine lacks (it has Python 3.12, torch, transformers, numpy, grpcio and more,
# but no hivemind and no network): hivemind and the project's pins it needs, for CPython 3.12 on
# x86-64, into .gpu/wheels (ignored by git; carried to the machine with the working tree, about
# 30 MB). scripts/gpu_next.sh installs them there. Run where pip reaches PyPI: make gpu-wheels
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
dest=.gpu/wheels
mkdir -p "$dest"
# binary wheels (pinned where the project pins them; grpcio and protobuf as the generated code needs)
binary=(hivemind==1.1.12 cryptography==50.0.2 grpcio==1.85.1 grpcio-tools==1.85.1
        protobuf==7.36.2 base58 configargparse cffi pycparser netaddr py-cid py-multihash
        py-multibase py-multicodec morphys blake3 mmh3 pydantic pydantic-core annotated-types
        typing-inspection)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platforms[@]}" -d "$dest" "${binary[@]}"
# pure-Python packages published as source only
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$dest" prefetch_generator varint
echo "gpu-wheels: $(ls "$dest" | wc -l) wheels, $(du -sh "$dest" | cut -f1) in $dest"
