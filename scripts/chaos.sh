#!/usr/bin/env bash
# The chaos run: worker processes take locks through fault-injecting proxies while the
# servers are stopped, restarted and failed over (on a Redis Cluster, slots migrated too);
# prints the counts as Markdown tables and exits 1 on an exclusion violation, a silent
# loss or an undocumented error.
#
#   bash scripts/chaos.sh                    # 3 minutes (CI runs --duration 90)
#   bash scripts/chaos.sh --duration 600     # the 10-minute run of docs/guarantees.md
#   bash scripts/chaos.sh --cluster          # on a Redis Cluster (CI runs --duration 60)
#   bash scripts/chaos.sh --help             # the other options (seed, processes, ...)
#
# Uses the python on PATH (an activated venv with joblock installed, as .ci/run has).
set -euo pipefail
cd "$(dirname "$0")/.."

duration=180
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    --duration) duration="${args[$((i + 1))]:-$duration}" ;;
    --duration=*) duration="${args[$i]#--duration=}" ;;
  esac
done
# A hard bound on the whole run: the chaos, then at most a few minutes to heal, let the
# last calls end and stop every server. The program stops its servers on SIGTERM.
bound=$(python -c "import math, sys; print(math.ceil(float(sys.argv[1])) + 300)" "$duration")
# The run lives in the test rig (tests/rig), beside the suite.
PYTHONPATH="tests${PYTHONPATH:+:$PYTHONPATH}" exec timeout --kill-after=30 "$bound" \
  python -m rig.chaos --duration "$duration" "$@"
