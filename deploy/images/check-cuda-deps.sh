#!/usr/bin/env bash
# Resolve the CUDA image's Python dependency set without building it: the GPU stack of
# cuda-requirements.txt and the project, for Ubuntu 24.04's CPython 3.12 on x86_64, with
# `pip install --dry-run` (metadata only: nothing is installed). Prints pip's plan.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip install --dry-run --ignore-installed --quiet --report "$work/report.json" \
  --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: \
  --no-deps -r deploy/images/cuda-requirements.txt >/dev/null
python3 - "$work/report.json" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))["install"]
for item in plan:
    meta = item["metadata"]
    print(f"{meta['name']}=={meta['version']}")
PY
