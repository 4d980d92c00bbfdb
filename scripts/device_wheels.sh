#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored; carried to the device with carry [".whl"]), the CPython 3.12
# manylinux wheels of pdserve's dependencies that the device image lacks (it has torch, triton,
# transformers and numpy). scripts/device_run.sh's `wheels` stage installs them there.
# PYDANTIC_CORE: the pydantic_core version the downloaded pydantic pins (2.50.5 for 2.14.4).
set -eu
plats=""
for p in manylinux_2_5 manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 \
         manylinux_2_28 manylinux_2_31 manylinux_2_34; do
  plats="$plats --platform ${p}_x86_64"
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $plats -d .whl gguf pyzmq msgspec fastapi starlette uvicorn h11 click prometheus_client aiohttp \
  aiohappyeyeballs aiosignal frozenlist multidict yarl propcache attrs pydantic \
  "pydantic_core==${PYDANTIC_CORE:-2.50.5}" annotated-types typing-inspection anyio sniffio pytest pytest-timeout pluggy iniconfig \
  hypothesis sortedcontainers idna typing_extensions annotated-doc opentelemetry-api llguidance \
  py-spy uvloop httptools
du -sh .whl
