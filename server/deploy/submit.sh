#!/usr/bin/env bash
# Submit the app to a SuperLink, wait for the run, and exit with ITS status (Flower 1.42's
# `flwr run` exits 0 even when the run fails, so this script asks `flwr ls` for the status).
#
# Usage: submit.sh [--app DIR] [--connection NAME] [--timeout S] [--poll S]
#                  [--run-config "k=v k2='s'"]...
#
#   --app DIR          the Flower app (default: the repository holding this script)
#   --connection NAME  a [superlink.NAME] entry of $FLWR_HOME/config.toml (default: its default)
#   --timeout S        give up (and stop the run) after S seconds (default 86400)
#   --run-config ...   overrides of [tool.flwr.app.config], repeatable
#
# The run's log streams to stderr while it runs. Exit status: 0 finished:completed,
# 1 finished:failed or finished:stopped, 2 usage or CLI error, 3 timed out (the run is
# stopped). Prints "run-id <ID>" at once and the run's final `flwr ls` record (JSON) at the end.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
app="$(cd "$here/../.." && pwd)" conn="" timeout=86400 poll=3 cfg=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --app) app="$(cd "$2" && pwd)"; shift 2 ;;
    --connection) conn="$2"; shift 2 ;;
    --timeout) timeout="$2"; shift 2 ;;
    --poll) poll="$2"; shift 2 ;;
    --run-config) cfg+=(--run-config "$2"); shift 2 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "submit.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$timeout" =~ ^[0-9]+$ && "$poll" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "submit.sh: --timeout/--poll must be numbers" >&2; exit 2; }
flwr="${FLWR_BIN_DIR:+$FLWR_BIN_DIR/}flwr"
home="${FLWR_HOME:-$HOME/.flwr}"
py="$(command -v python3 || command -v python)"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

# json FIELD < text: FIELD (dotted) of the JSON object in flwr's output ("" if none), read by
# cli_json.py next to this script -- the one parser of flwr JSON output, stdlib Python only.
json() { "$py" "$here/cli_json.py" "$1"; }

# CLI calls other than `run` from FLWR_HOME: a cwd with a pyproject.toml may be "migrated"
cli() { (cd "$home" && "$flwr" "$@"); }

out="$("$flwr" run "$app" ${conn:+"$conn"} "${cfg[@]}" --format json 2>&1)" || true
run_id="$(json run-id <<<"$out")"
if [[ -z "$run_id" ]]; then
  echo "submit.sh: flwr run failed: $(json error-message <<<"$out")" >&2
  echo "$out" | tail -n 20 >&2
  exit 2
fi
echo "run-id $run_id"

deadline=$(( $(date +%s) + timeout ))
# Follow the run's log (on stderr) until the run ends: progress for the user, no polling.
# `flwr log --stream` returns when the run finishes; the status loop below confirms it.
(cd "$home" && timeout "$timeout" "$flwr" log "$run_id" ${conn:+"$conn"} --stream) >&2 || true
status=""
while :; do
  ls_out="$(cli ls ${conn:+"$conn"} --run-id "$run_id" --format json 2>&1)" || true
  status="$(json runs.status <<<"$ls_out")"
  [[ "$status" == finished:* ]] && break
  if (( $(date +%s) >= deadline )); then
    echo "submit.sh: run $run_id not finished after ${timeout}s (status ${status:-unknown}); stopping it" >&2
    cli stop "$run_id" ${conn:+"$conn"} --format json >/dev/null 2>&1 || true
    exit 3
  fi
  sleep "$poll"
done
json runs <<<"$ls_out"
if [[ "$status" == "finished:completed" ]]; then
  exit 0
fi
echo "submit.sh: run $run_id ended with status $status: $(json runs.status-details <<<"$ls_out")" >&2
exit 1
