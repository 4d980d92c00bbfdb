#!/usr/bin/env bash
# Prepares Ray for the GPU machine, which lacks it. Its cp312 wheel (about 79 MB) is over one
# call's 64 MiB, so .whl-ray/slim (git-ignored) gets the wheel without what pdserve never imports
# (the Java jar, 32 MB; the dashboard's web client; rllib, tune, train, data, serve, llm; their
# RECORD lines go too), about 40 MB, with the dependencies the image may lack. One call:
#   carry [".whl", ".whl-ray/slim"]  bash scripts/device_run.sh wheels ray-stash ray-install ray-tests
# (the tracked files travel too: the total must stay under 64 MiB).
set -eu
plats=""
for p in manylinux2014 manylinux_2_17 manylinux_2_28; do plats="$plats --platform ${p}_x86_64"; done
rm -rf .whl-ray && mkdir -p .whl-ray/slim .whl-ray/all
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $plats -d .whl-ray/all "ray==2.60.0" msgpack protobuf jsonschema jsonschema-specifications \
  referencing rpds-py attrs filelock pyyaml click
python3 - .whl-ray/all .whl-ray/slim <<'PY'
import os, shutil, sys, zipfile
src_dir, dst_dir = sys.argv[1:]
drop = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/llm/", "ray/tune/", "ray/train/",
        "ray/data/", "ray/serve/")
for name in os.listdir(src_dir):
    src, dst = os.path.join(src_dir, name), os.path.join(dst_dir, name)
    if not name.startswith("ray-"):
        shutil.copy(src, dst)
        continue
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            if info.filename.startswith(drop):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(True)
                                if not line.startswith(tuple(d.encode() for d in drop)))
            zout.writestr(info, data, compress_type=info.compress_type)
PY
rm -rf .whl-ray/all
du -sh .whl-ray/slim
