#!/usr/bin/env bash
# joblock's assurance checks, each failing the script on any report:
#   asan  the compiled core and engine built with AddressSanitizer and
#         UndefinedBehaviorSanitizer (scripts/sanitize.sh) running the core's, the
#         readers', the engine's, the batch and the asyncio tests;
#   fuzz  a bounded, coverage-guided fuzz run of the compiled reader against the pure one,
#         and of the compiled wire fed the same bytes (scripts/fuzz_reader.py on the build
#         of scripts/sanitize.sh --fuzz: ASan and UBSan watch the C code while libFuzzer
#         follows its coverage);
#   leak  the leak check (scripts/leak_check.py): real acquire/release cycles on the
#         normal compiled core and engine, resident memory flat once warm.
#
#   scripts/assurance.sh                 # all three
#   scripts/assurance.sh fuzz leak       # some of them
#   ASSURANCE_FUZZ_SECONDS=600 ASSURANCE_LEAK_CYCLES=1000000 scripts/assurance.sh
#
# PYTHON (default python3) must have the test dependencies and, for the leak check,
# joblock with its compiled core installed (the venv of the README's test command, or
# an editable install with the core built in place). The sanitized builds live in
# temporary directories put first on PYTHONPATH, and Cython and atheris are installed
# into one more (pip --target): nothing installed in PYTHON's environment changes, so
# whatever runs after this still tests the normal build. Installs clang from Debian's
# packages when it is missing and apt-get is there (the fuzz build needs clang).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
fuzz_seconds=${ASSURANCE_FUZZ_SECONDS:-60}
# Half of leak_check.py's million: one small object leaked per cycle already grows the
# resident set by about 40 MiB there, ten times the bound, in half the time.
leak_cycles=${ASSURANCE_LEAK_CYCLES:-500000}
checks=("$@")
[ ${#checks[@]} -gt 0 ] || checks=(asan fuzz leak)
for check in "${checks[@]}"; do
  case $check in asan | fuzz | leak) ;; *) echo "assurance: no check named $check (asan, fuzz, leak)" >&2; exit 2 ;; esac
done

step() { printf '\n== assurance: %s\n' "$*"; }
timings=()
timed() {
  local name=$1 started=$SECONDS
  shift
  "$@"
  timings+=("$(printf '%-44s %4ss' "$name" "$((SECONDS - started))")")
}

work=$(mktemp -d "${TMPDIR:-/tmp}/joblock-assurance.XXXXXX")
trap 'rm -rf "$work"' EXIT
tools=$work/tools
export PYTHON=$python

if [[ " ${checks[*]} " == *" asan "* || " ${checks[*]} " == *" fuzz "* ]]; then
  if ! command -v clang >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    step "installing clang and its sanitizer runtimes (Debian's clang, libclang-rt-dev)"
    install_clang() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libclang-rt-dev >/dev/null; }
    install_clang || { apt-get update -qq && install_clang; }
  fi
  command -v clang >/dev/null 2>&1 || { echo "assurance: clang is needed for the fuzz build" >&2; exit 2; }
  step "Cython and atheris into $tools (PYTHON's environment is left as it is)"
  "$python" -m pip install -q --disable-pip-version-check --target "$tools" Cython atheris
  export PYTHONPATH="$tools${PYTHONPATH:+:$PYTHONPATH}"
fi

# The tests of the compiled twin and of the twins' agreement (-k "not python": the pure
# twins run none of the core's C code; the engine's, which every twin goes through, the
# compiled twin's tests cover).
asan_tests=(
  tests/test_differential.py tests/test_parser.py tests/test_keys.py tests/test_cluster_slots.py
  tests/test_batches.py tests/test_locks.py tests/test_engine.py tests/test_engine_builds.py tests/test_aio.py
  -k "not python" -p no:cacheprovider -q
)

fuzz() {  # fuzz [--tests PYTEST-ARGS]: on the fuzz build, the tests if given, then the fuzzer
  # libFuzzer reports every new input it keeps: that goes to a log, whose tail is shown
  # when it fails (the sanitizer report, the failed test, or the readers' difference with
  # its input). The files it writes go to the temporary directory rather than the work tree.
  mkdir -p "$work/fuzz"
  if ! bash scripts/sanitize.sh --fuzz -max_total_time="$fuzz_seconds" -artifact_prefix="$work/fuzz/" "$@" \
    >"$work/fuzz.log" 2>&1; then
    tail -n 80 "$work/fuzz.log" >&2
    echo "assurance: a test failed, or fuzz_reader found a difference, a crash or a sanitizer report (above)" >&2
    return 1
  fi
  grep -E '^== |^Done [0-9]+ runs|^[0-9]+ passed' "$work/fuzz.log"
}
wants() { [[ " ${checks[*]} " == *" $1 "* ]]; }

for check in "${checks[@]}"; do
  case $check in
    asan)
      if wants fuzz; then
        # The fuzz build is the ASan/UBSan build with libFuzzer's coverage hooks added:
        # the tests run on it as well, and the sanitized compile (minutes) happens once.
        step "asan and fuzz on one ASan/UBSan build: core, reader, engine, batch and asyncio tests," \
          "then the compiled reader against the pure one, and the compiled wire, for ${fuzz_seconds} s"
        timed "asan + fuzz: sanitized tests, fuzz_reader ${fuzz_seconds} s" fuzz --tests "${asan_tests[@]}"
      else
        step "asan: core, reader, engine, batch and asyncio tests on the ASan/UBSan build"
        timed "asan: sanitized core and engine tests" bash scripts/sanitize.sh "${asan_tests[@]}"
      fi
      ;;
    fuzz)
      wants asan && continue  # run with the asan tests, on their build (above)
      step "fuzz: the compiled reader against the pure one, and the compiled wire, for ${fuzz_seconds} s"
      timed "fuzz: fuzz_reader, ${fuzz_seconds} s" fuzz
      ;;
    leak)
      step "leak: $leak_cycles acquire/release cycles on the compiled core and hot path, threads then asyncio"
      timed "leak: leak_check, $leak_cycles cycles" "$python" scripts/leak_check.py --core c \
        -n "$leak_cycles" --every "$((leak_cycles / 10))"
      # The asyncio driver's: a fifth as many cycles (they are slower), the same bound.
      timed "leak: leak_check --asyncio, $((leak_cycles / 5)) cycles" "$python" scripts/leak_check.py \
        --core c --asyncio -n "$((leak_cycles / 5))" --every "$((leak_cycles / 50))"
      ;;
  esac
done

step "clean (${checks[*]}): no sanitizer report, no fuzz finding, no leak"
printf '%s\n' "${timings[@]}"
