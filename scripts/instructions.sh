#!/usr/bin/env bash
# User-space instructions per single acquire + release pair, counted by callgrind, for
# joblock (Locks and AsyncLocks, compiled and pure) and for the bare socket and protocol
# sending the same two commands: the figures of docs/performance.md ("Where the time
# goes"). A count, not a time, so it comes out the same whatever the machine's load.
# Prints a Markdown table; about 3 minutes on 2 free cores (5 on a busy machine).
#
#   bash scripts/instructions.sh                          # every subject, both builds
#   bash scripts/instructions.sh --only sync --only bare-socket
#   JOBLOCK_SERVER=valkey bash scripts/instructions.sh --only sync --only bare-socket  # DELIFEQ
#   bash scripts/instructions.sh --keep /tmp/callgrind    # keep the profiles, then:
#   callgrind_annotate /tmp/callgrind/callgrind.sync.compiled.12000.out
#
# The method and its options: python scripts/instructions.py --help. Uses the python on
# PATH (an activated venv with joblock installed and its core built, e.g. pip install -e .)
# and redis-server (valkey-server with JOBLOCK_SERVER=valkey); installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v valgrind >/dev/null 2>&1; then
  echo "valgrind is not installed: it is what counts the instructions (Debian, Ubuntu: apt-get install valgrind)" >&2
  exit 1
fi
exec python scripts/instructions.py "$@"
