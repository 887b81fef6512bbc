#!/usr/bin/env bash
# Extracts files of vLLM 0.33.0's source distribution into CACHE/vllm-0.33.0, fetching the
# sdist through pip's configured index once (sha256-checked) into CACHE.
#
# Usage: runtime/python/scripts/vllm-src.sh CACHE PYTHON MEMBER... (members relative to the
#        tree, shell globs allowed: 'vllm/*.py')
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=$1 python=$2
shift 2
sdist=$cache/vllm-0.33.0.tar.gz
if [ ! -f "$sdist" ]; then
  url=$("$python" "$here/sdist_url.py" vllm 0.33.0)
  curl -sSfL --retry 3 -o "$sdist.part" "$url"
  mv "$sdist.part" "$sdist"
fi
echo "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112  $sdist" | sha256sum -c --quiet -
tar xzf "$sdist" -C "$cache" --wildcards "${@/#/vllm-0.33.0/}"
