#!/usr/bin/env bash
# Resolve the CUDA image's Python dependency set without building it: the GPU stack of
# cuda-requirements.txt and the project, for Ubuntu 24.04's CPython 3.12 on x86_64, with
# `pip install --dry-run` (metadata only: nothing is installed). Prints pip's plan: every
# package with the version it would install; fails if the set does not resolve.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The project's own dependencies, as pyproject.toml lists them (torch unpinned there: the
# pin above decides), resolved together with the GPU stack.
# Pure-Python packages published only as source cannot be resolved for another interpreter
# (pip's rule): they are resolved for this one, without their dependencies, which are
# listed among the project's or are resolved below with the rest.
SOURCE_ONLY="nkeys"
# Ubuntu 24.04's glibc 2.39 takes every manylinux wheel up to 2_39 (pip does not widen an
# explicit --platform by itself).
platforms=$(for v in $(seq 39 -1 5); do printf -- '--platform manylinux_2_%s_x86_64 ' "$v"; done)
platforms+="--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64"
python3 - "$SOURCE_ONLY" > "$work/project.txt" <<'PY'
import re, sys, tomllib
skip = set(sys.argv[1].split())
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if re.split(r"[<>=!~\[ ;]", dep, maxsplit=1)[0].lower() not in skip:
        print(dep)
PY
python3 -m pip install --dry-run --ignore-installed --quiet --no-deps $SOURCE_ONLY pynacl >/dev/null
python3 -m pip install --dry-run --ignore-installed --quiet --report "$work/report.json" \
  --target "$work/target" --python-version 3.12 --implementation cp $platforms \
  --only-binary=:all: -r deploy/images/cuda-requirements.txt -r "$work/project.txt" \
  pynacl >/dev/null
echo "$SOURCE_ONLY (source only, pure Python: resolved for this interpreter)"
python3 - "$work/report.json" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))["install"]
for item in plan:
    meta = item["metadata"]
    print(f"{meta['name']}=={meta['version']}")
PY
