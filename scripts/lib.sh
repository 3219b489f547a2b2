# shellcheck shell=bash
# Helpers shared by the scripts beside it; sourced, not run.

# find_python 3.12: prints the path of a CPython 3.12 (with the GIL) and returns 0, or
# returns 1 when there is none. pyenv's newest 3.12.x comes first, then python3.12 on
# PATH; each candidate is asked its version, so a pyenv shim for a version that is not
# installed, or a free-threaded build, is passed over.
find_python() {
  local want=$1 py
  local candidates=()
  for py in "${PYENV_ROOT:-$HOME/.pyenv}/versions/$want".*/bin/python; do
    [ -x "$py" ] && candidates+=("$py")
  done
  if [ ${#candidates[@]} -gt 0 ]; then
    mapfile -t candidates < <(printf '%s\n' "${candidates[@]}" | sort -V -r)
  fi
  py=$(command -v "python$want" 2>/dev/null) && candidates+=("$py")
  for py in "${candidates[@]}"; do
    if [ "$("$py" -c 'import platform, sys, sysconfig
gil = not sysconfig.get_config_var("Py_GIL_DISABLED")
if platform.python_implementation() == "CPython" and gil:
    print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$want" ]; then
      echo "$py"
      return 0
    fi
  done
  return 1
}

# snapshot ROOT DEST: copies ROOT's tracked and untracked (not ignored) files to DEST, so
# stale build/ output, a leftover _core_c.c or an in-place .so can neither help nor hurt a
# build, and builds leave ROOT alone. Outside a git checkout, the tree less its build products.
snapshot() {
  local root=$1 dest=$2
  mkdir -p "$dest"
  if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$root" && git ls-files -z --cached --others --exclude-standard) \
      | while IFS= read -r -d '' f; do if [ -e "$root/$f" ]; then printf '%s\0' "$f"; fi; done \
      | tar --null -C "$root" -T - -cf - | tar -xf - -C "$dest"
  else
    tar -C "$root" --exclude=./build --exclude=./dist --exclude='*.egg-info' --exclude='*.so' \
      --exclude=./src/joblock/_core_c.c --exclude='./.venv*' -cf - . | tar -xf - -C "$dest"
  fi
  [ -f "$dest/src/joblock/_core_c.pyx" ] || { echo "snapshot of $root has no src/joblock/_core_c.pyx" >&2; return 1; }
}

# wheel_for 3.12: prints the path of the joblock wheel for CPython 3.12 that an earlier
# step left in $JOBLOCK_WHEELHOUSE (check-dist.sh keeps the wheels it built and checked
# there, so that .ci/run compiles the core once per CPython), and returns 0; returns 1
# when there is none (no wheelhouse, or no wheel for that version): build from source.
wheel_for() {
  local tag=cp${1/./} wheel
  [ -n "${JOBLOCK_WHEELHOUSE:-}" ] || return 1
  for wheel in "$JOBLOCK_WHEELHOUSE"/joblock-*-"$tag"-"$tag"-*.whl; do
    [ -f "$wheel" ] && { echo "$wheel"; return 0; }
  done
  return 1
}
