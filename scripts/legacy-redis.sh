#!/usr/bin/env bash
# The arq and taskiq tests (tests_legacy/), in a venv of their own: arq 0.28 and
# taskiq-redis 1.0 require redis-py < 6, which the main suite's venv (the `test` extra,
# redis-py 8) cannot hold. Builds that venv from scratch on CPython 3.11 (pyenv or
# python3.11 on PATH), installs `.[test,arq,taskiq]` with redis-py < 6 from a snapshot of
# the tree, prints what pip resolved, checks that the compiled core is in use, then runs
# the tests with JOBLOCK_REQUIRE_C=1 against real redis-servers and real arq and taskiq
# workers. Prints the time of the install and of the tests.
#
#   scripts/legacy-redis.sh           # CPython 3.11
#   scripts/legacy-redis.sh 3.12      # another CPython
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

version=${1:-3.11}
py=$(find_python "$version") || { echo "CPython $version not found (neither pyenv nor python$version)" >&2; exit 1; }

# Flags that would change what is built or tested come from this script.
unset JOBLOCK_NO_EXTENSIONS CIBUILDWHEEL CC PIP_NO_BUILD_ISOLATION || true
export PIP_DISABLE_PIP_VERSION_CHECK=1

WORK=$(mktemp -d "${TMPDIR:-/tmp}/joblock-legacy-redis.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
snapshot "$ROOT" "$WORK/src"

echo "== legacy redis-py venv: CPython $version ($py)"
started=$SECONDS
"$py" -m venv "$WORK/venv"
# The wheel check-dist.sh built and checked for this CPython, if .ci/run kept it; else the source.
project=$WORK/src
if wheel=$(wheel_for "$version"); then project=$wheel; fi
if ! "$WORK/venv/bin/python" -m pip install "$project[test,arq,taskiq]" 'redis<6' >"$WORK/install.log" 2>&1; then
  tail -n 40 "$WORK/install.log" >&2
  echo "FAILED to install joblock[test,arq,taskiq] with redis<6" >&2
  exit 1
fi
installed=$((SECONDS - started))
(cd "$WORK" && "$WORK/venv/bin/python" - <<'PY')
import importlib.metadata as md
import joblock

names = ("redis", "hiredis", "arq", "taskiq", "taskiq-redis", "pytest")
print("   ", ", ".join(f"{n} {md.version(n)}" for n in names))
print(f"    joblock.implementation = {joblock.implementation}")
assert int(md.version("redis").split(".")[0]) < 6, "pip resolved redis-py 6 or later"
assert joblock.implementation == "c", "the compiled core did not build or load"
PY
"$WORK/venv/bin/python" -m pip check

# From the snapshot's root, so pytest takes pyproject.toml's settings while joblock is
# imported from the venv (the snapshot's src/ is not on sys.path).
tested=$SECONDS
(cd "$WORK/src" && JOBLOCK_REQUIRE_C=1 "$WORK/venv/bin/python" -m pytest tests_legacy -q -p no:cacheprovider)
echo "== legacy redis-py: install ${installed}s, tests $((SECONDS - tested))s"
