#!/usr/bin/env bash
# Download, here (where pip reaches PyPI), the wheels the GPU check needs on a lent
# H200 machine that its image lacks (device README: python 3.12, torch 2.11.0+cu130,
# no network there). gpu_check.sh installs whatever is in .whl/ with --no-deps into
# /tmp/gpucheck-site before its parts run. Pinned to the versions this repo's venv
# runs; --no-deps, so each missing dependency is named here (checked against the
# image's package list in /work/.library/device/KINDS.md: tokenizers, pyarrow,
# pandas, xxhash, einops, tensorboard, pillow, requests, huggingface-hub are there).
# wandb is left out: torchtitan imports it only when its wandb logging is enabled.
#
#   bash benchmarks/gpu_check/fetch_wheels.sh      # from the repo root; then carry .whl
set -eu
cd "$(dirname "$0")/../.."
mkdir -p .whl
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $PLAT -d .whl \
  torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 spmd_types==0.2.3 \
  datasets==4.7.0 "dill>=0.3.0,<0.4.1" "multiprocess<0.70.19" tyro==1.0.17 \
  docstring-parser typeguard zlib-ng
du -sh .whl
