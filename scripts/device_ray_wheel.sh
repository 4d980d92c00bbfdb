#!/usr/bin/env bash
# Prepares Ray for the GPU machine, which lacks it: its cp312 wheel (about 79 MB) is over one
# call's 64 MiB, so it is cut in two under .whl-ray/1 and .whl-ray/2 (git-ignored), with the
# dependencies the image may lack in the second part. Carry one part per call, on a machine kept
# warm between the two calls (/tmp survives there):
#   call 1: carry [".whl", ".whl-ray/1"]  bash scripts/device_run.sh ray-stash
#   call 2: carry [".whl", ".whl-ray/2"]  bash scripts/device_run.sh wheels ray-stash ray-install ray-tests
set -eu
plats=""
for p in manylinux2014 manylinux_2_17 manylinux_2_28; do plats="$plats --platform ${p}_x86_64"; done
rm -rf .whl-ray && mkdir -p .whl-ray/1 .whl-ray/2 .whl-ray/all
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $plats -d .whl-ray/all "ray==2.60.0" msgpack protobuf jsonschema jsonschema-specifications \
  referencing rpds-py attrs filelock pyyaml click
ray=$(ls .whl-ray/all/ray-*.whl)
split -b 40M "$ray" ".whl-ray/1/$(basename "$ray").part-"
mv .whl-ray/1/*.part-ab .whl-ray/2/
mv $(ls .whl-ray/all/*.whl | grep -v '/ray-') .whl-ray/2/
rm -rf .whl-ray/all
du -sh .whl-ray/1 .whl-ray/2
