#!/usr/bin/env bash
# Builds joblock's compiled core and hot path with AddressSanitizer and
# UndefinedBehaviorSanitizer into a temporary copy of the package, runs the test suite
# on it, and fails on any sanitizer report (or any failing test).
#
#   scripts/sanitize.sh                            # the compiled twin's tests (~10 min here)
#   scripts/sanitize.sh tests/test_parser.py -x    # arguments go to pytest instead
#   scripts/sanitize.sh --fuzz -max_total_time=60  # scripts/fuzz_reader.py on the build,
#                                                  # coverage-guided on the C code too
#   scripts/sanitize.sh --fuzz -max_total_time=60 --tests tests/test_parser.py
#                                                  # the tests first, on that same build
#
# The fuzz build carries libFuzzer's coverage hooks on top of the same sanitizers, so the
# tests run on it as on the plain one: one build serves both when both are wanted.
# The interpreter is not instrumented: the ASan runtime is preloaded (LD_PRELOAD) so the
# extension loads into a plain CPython, PYTHONMALLOC=malloc sends Python's allocations
# through ASan so overruns of Python objects show, and leak detection is off (CPython
# frees little at exit; tests/test_leaks.py and scripts/leak_check.py measure leaks).
# Redis servers started by the tests run without the preload.
#
# hiredis is kept out of the run (JOBLOCK_SANITIZE_HIREDIS=1 keeps it): it is not
# joblock's code (redis-py parses the tests' own commands with it), and ASan reports a
# heap-buffer-overflow read inside hiredis-py 3.5's createStringObject while redis-py
# parses INFO replies in tests/test_aio.py, on every twin, the pure ones included.
#
# Needs clang (apt-get install clang libclang-rt-14-dev) or gcc with libasan and
# libubsan; --fuzz needs clang and atheris. Linux only.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=${PYTHON:-python3}

fuzz=0
fuzz_args=()
tests=1
if [[ ${1:-} == --fuzz ]]; then
  fuzz=1
  tests=0
  shift
  # libFuzzer's arguments, up to --tests; pytest's after it.
  while [[ $# -gt 0 && $1 != --tests ]]; do
    fuzz_args+=("$1")
    shift
  done
  if [[ ${1:-} == --tests ]]; then
    tests=1
    shift
  fi
fi

cc=${CC:-}
if [[ -z $cc ]]; then
  if command -v clang >/dev/null 2>&1; then cc=clang; else cc=gcc; fi
fi
flags=(-fsanitize=address,undefined -fno-sanitize-recover=undefined)
if [[ $fuzz == 1 ]]; then
  [[ $($cc --version) == *clang* ]] || { echo "sanitize.sh: --fuzz needs clang" >&2; exit 2; }
  # libFuzzer's ASan runtime as atheris ships it: ASan, UBSan and the coverage hooks in one.
  runtime="$("$python" -c 'import atheris; print(atheris.path())')/asan_with_fuzzer.so"
  flags=(-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined)
elif [[ $($cc --version) == *clang* ]]; then
  # clang's ASan runtime carries UBSan's handlers; the extension links against it.
  runtime=$($cc -print-file-name="libclang_rt.asan-$(uname -m).so")
  # clang 15 and newer keep it per target triple, without the arch in its name.
  [[ -f $runtime ]] || runtime=$($cc -print-file-name=libclang_rt.asan.so)
  flags+=(-shared-libasan)
else
  runtime="$($cc -print-file-name=libasan.so) $($cc -print-file-name=libubsan.so)"
fi
for lib in $runtime; do
  [[ -f $lib ]] || { echo "sanitize.sh: no sanitizer runtime for $cc ($lib)" >&2; exit 2; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src/joblock" "$work/bin" "$work/reports" "$work/nohiredis"
# The package's Python modules, its subpackages' too; the core is the build below.
tar -C src --exclude=__pycache__ --exclude='*.so' --exclude='*.c' --exclude='*.pyx' -cf - joblock \
  | tar -xf - -C "$work/src"

echo "== building the core and the hot path's compiled modules with $cc ${flags[*]}"
include=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
build() {  # build SOURCE MODULE-PATH: cythonize SOURCE (with its .pxd) and compile it there
  local c="$work/${2//\//.}.c"
  "$python" -m cython -3 --directive annotation_typing=False "$1" -o "$c"
  "$cc" -shared -fPIC -g -O1 -fno-omit-frame-pointer "${flags[@]}" -I"$include" "$c" -o "$work/src/$2$suffix"
}
# The core, and the hot path as setup.py compiles it (each module with a .pxd), built
# side by side: they are independent.
pids=()
build src/joblock/_core_c.pyx joblock/_core_c &
pids+=($!)
hot=()
for pxd in src/joblock/*.pxd src/joblock/_engine/*.pxd; do
  module=${pxd#src/}
  module=${module%.pxd}
  build "src/$module.py" "$module" &
  pids+=($!)
  hot+=("${module//\//.}")
done
for pid in "${pids[@]}"; do wait "$pid"; done

# redis-server, found as the tests find it, but without the preloaded runtime.
real_redis=$(PYTHONPATH="$root/src" "$python" -c 'from joblock._tools.servers import find_redis_server as f; print(f())')
cat >"$work/bin/redis-server" <<WRAP
#!/bin/sh
unset LD_PRELOAD ASAN_OPTIONS UBSAN_OPTIONS PYTHONMALLOC
exec '$real_redis' "\$@"
WRAP
chmod +x "$work/bin/redis-server"
export PATH="$work/bin:$PATH"
export JOBLOCK_REDIS_SERVER="$work/bin/redis-server"

path="$work/src"
if [[ ${JOBLOCK_SANITIZE_HIREDIS:-0} == 0 ]]; then
  echo 'raise ImportError("hiredis is kept out of the sanitized run (scripts/sanitize.sh)")' \
    >"$work/nohiredis/hiredis.py"
  path="$path:$work/nohiredis"
fi
export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}"
export JOBLOCK_REQUIRE_C=1
export PYTHONMALLOC=${PYTHONMALLOC:-malloc}
export LD_PRELOAD="$runtime"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:log_path=$work/reports/asan:verify_asan_link_order=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$work/reports/ubsan"

"$python" -c "
import importlib, joblock, joblock._core_c as c
assert c.__file__.startswith('$work'), c.__file__
assert joblock.implementation == 'c'
for name in '${hot[*]}'.split():
    module = importlib.import_module(name)
    assert module.__file__.startswith('$work') and not module.__file__.endswith('.py'), module.__file__
print('== the sanitized core and hot path loaded:', c.__file__, '(${hot[*]})')
"

status=0
if [[ $tests == 1 ]]; then
  if [[ $# -eq 0 ]]; then
    # Every test of the compiled twin, and the tests that compare the twins (the pure
    # twins' own runs add nothing here).
    set -- tests -k "not python" -p no:cacheprovider -q
    if [[ ${JOBLOCK_SANITIZE_HIREDIS:-0} == 0 ]]; then
      # It checks that the pure core takes hiredis when it can be found: here it cannot.
      set -- "$@" --deselect tests/test_implementation.py::test_pure_core_reads_replies_with_hiredis_when_importable
    fi
  fi
  (cd "$root" && "$python" -m pytest "$@") || status=$?
fi
if [[ $fuzz == 1 && $status == 0 ]]; then
  (cd "$root" && "$python" scripts/fuzz_reader.py "${fuzz_args[@]+"${fuzz_args[@]}"}") || status=$?
fi

if [[ -n $(find "$work/reports" -type f) ]]; then
  echo "== sanitizer reports:" >&2
  cat "$work"/reports/* >&2
  exit 1
fi
if [[ $status -ne 0 ]]; then
  echo "== failed under the sanitizers (exit $status), without a sanitizer report" >&2
  exit "$status"
fi
echo "== clean: no AddressSanitizer or UndefinedBehaviorSanitizer report"
