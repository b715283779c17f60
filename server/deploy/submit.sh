#!/usr/bin/env bash
# Submit the app to a SuperLink, wait for the run, and exit with ITS status (Flower 1.42's
# `flwr run` exits 0 even when the run fails, so this script asks `flwr ls` for the status).
#
# Usage: submit.sh [--app DIR] [--connection NAME] [--timeout S] [--poll S]
#                  [--restarts N] [--restart-delay S] [--run-config "k=v k2='s'"]...
#
#   --app DIR          the Flower app (default: the repository holding this script)
#   --connection NAME  a [superlink.NAME] entry of $FLWR_HOME/config.toml (default: its default)
#   --timeout S        give up (and stop the run) after S seconds, restarts included (default 86400)
#   --restarts N       a run that failed or whose ServerApp died is submitted again with resume=true
#                      (from its last checkpoint), up to N times; each restart is logged with its
#                      cause. Not restarted (the reason is said): a stopped run, a refused config, a
#                      run that cannot resume (no checkpoint behind its rows, a changed config), the
#                      same failure twice in a row, a changed app (server/deploy/restarts.py).
#                      Needs a fixed run-name in the k=v overrides (default 0: no restart)
#   --restart-delay S  seconds before a restart, and between tries to submit it (default 10)
#   --run-config ...   overrides of [tool.flwr.app.config], repeatable
#
# The run's log streams to stderr while it runs. Exit status: 0 finished:completed,
# 1 finished:failed or finished:stopped (after the restarts), 2 usage or CLI error, 3 timed out
# (the run is stopped). Prints "run-id <ID>" for every run submitted and the last run's final
# `flwr ls` record (JSON) at the end.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
app="$(cd "$here/../.." && pwd)" conn="" timeout=86400 poll=3 cfg=() restarts=0 restart_delay=10
while [[ $# -gt 0 ]]; do
  case "$1" in
    --app) app="$(cd "$2" && pwd)"; shift 2 ;;
    --connection) conn="$2"; shift 2 ;;
    --timeout) timeout="$2"; shift 2 ;;
    --poll) poll="$2"; shift 2 ;;
    --restarts) restarts="$2"; shift 2 ;;
    --restart-delay) restart_delay="$2"; shift 2 ;;
    --run-config) cfg+=(--run-config "$2"); shift 2 ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "submit.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$timeout" =~ ^[0-9]+$ && "$poll" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "submit.sh: --timeout/--poll must be numbers" >&2; exit 2; }
[[ "$restarts" =~ ^[0-9]+$ ]] || { echo "submit.sh: --restarts must be an integer >= 0, got $restarts" >&2; exit 2; }
[[ "$restart_delay" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "submit.sh: --restart-delay must be a number of seconds, got $restart_delay" >&2; exit 2; }
if (( restarts > 0 )); then  # a restart resumes run-name's folder: k=v overrides that name it
  given="${cfg[*]:-}"
  for ((i = 1; i < ${#cfg[@]}; i += 2)); do
    [[ "${cfg[i]}" == *=* ]] || { echo "submit.sh: --restarts needs the run config as k=v overrides (flwr run refuses a TOML file together with the resume=true a restart adds), got ${cfg[i]}" >&2; exit 2; }
  done
  [[ "$given" =~ (^|[[:space:]])run-name[[:space:]]*=[[:space:]]*[\'\"]?[^\'\"[:space:]] ]] || {
    echo "submit.sh: --restarts needs a fixed run-name (run-name='NAME' in --run-config): a restart resumes that folder" >&2; exit 2; }
fi
flwr="${FLWR_BIN_DIR:+$FLWR_BIN_DIR/}flwr"
home="${FLWR_HOME:-$HOME/.flwr}"
py="$(command -v python3 || command -v python)"
flwr_py="$(dirname "$(command -v "$flwr")")/python"  # the interpreter of flwr's environment (restarts.py fab-hash)
[[ -x "$flwr_py" ]] || flwr_py="$py"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

# json FIELD < text: FIELD (dotted) of the JSON object in flwr's output ("" if none), read by
# cli_json.py next to this script -- the one parser of flwr JSON output, stdlib Python only.
json() { "$py" "$here/cli_json.py" "$1"; }

# CLI calls other than `run` from FLWR_HOME: a cwd with a pyproject.toml may be "migrated"
cli() { (cd "$home" && "$flwr" "$@"); }

logf="$(mktemp "${TMPDIR:-/tmp}/celgc-submit.XXXXXX")"
trap 'rm -f "$logf"' EXIT
deadline=$(( $(date +%s) + timeout ))
attempt=0 extra=() first_hash="" first_run="" previous_cause=""
while :; do
  out="$("$flwr" run "$app" ${conn:+"$conn"} "${cfg[@]}" ${extra[@]+"${extra[@]}"} --format json 2>&1)" || true
  run_id="$(json run-id <<<"$out")"
  if [[ -z "$run_id" ]]; then
    if (( attempt == 0 )); then
      echo "submit.sh: flwr run failed: $(json error-message <<<"$out")" >&2
      echo "$out" | tail -n 20 >&2
      exit 2
    fi
    # a restart that could not be submitted (the SuperLink is restarting?): try again until --timeout
    if (( $(date +%s) >= deadline )); then
      echo "submit.sh: restart $attempt/$restarts could not be submitted within --timeout: $(json error-message <<<"$out")" >&2
      exit 3
    fi
    echo "submit.sh: restart $attempt/$restarts not submitted ($(json error-message <<<"$out" | head -c 300)); again in ${restart_delay}s" >&2
    sleep "$restart_delay"
    continue
  fi
  echo "run-id $run_id"
  [[ -n "$first_hash" ]] || { first_hash="$(json fab-hash <<<"$out")"; first_run="$run_id"; }

  # Follow the run's log (on stderr, and into $logf for the cause) until the run ends: progress for
  # the user, no polling. `flwr log --stream` returns when the run finishes (or its SuperLink goes);
  # the status loop below confirms it.
  left=$(( deadline - $(date +%s) )); (( left > 0 )) || left=1
  : > "$logf"
  (cd "$home" && timeout "$left" "$flwr" log "$run_id" ${conn:+"$conn"} --stream 2>&1) | tee -a "$logf" >&2 || true
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
  if [[ "$status" == "finished:completed" ]]; then
    json runs <<<"$ls_out"
    exit 0
  fi
  details="$(json runs.status-details <<<"$ls_out")"
  { IFS= read -r verdict; IFS= read -r why; } < <("$py" "$here/restarts.py" verdict "$status" "$details" "$previous_cause" < "$logf")
  if [[ "$verdict" == restart && $attempt -lt $restarts ]]; then
    if ! now_hash="$("$flwr_py" "$here/restarts.py" fab-hash "$app" 2>&1)"; then
      verdict=stop why="the app's code could not be checked ($(tail -n 1 <<<"$now_hash"))"
    elif [[ -n "$first_hash" && "${now_hash:0:${#first_hash}}" != "$first_hash" ]]; then
      verdict=stop why="the app's code changed since run $first_run was submitted (FAB $first_hash, now ${now_hash:0:8}): resume by hand with resume=true if that is intended"
    fi
  fi
  if [[ "$verdict" != restart || $attempt -ge $restarts ]]; then
    json runs <<<"$ls_out"
    echo "submit.sh: run $run_id ended with status $status: $details" >&2
    if (( restarts > 0 )); then
      if [[ "$verdict" != restart ]]; then
        echo "submit.sh: not restarted: $why" >&2
      else
        echo "submit.sh: not restarted: all $restarts restart(s) used ($why)" >&2
      fi
    fi
    exit 1
  fi
  attempt=$(( attempt + 1 ))
  previous_cause="$why"
  echo "submit.sh: restart $attempt/$restarts of run $run_id ($status): $why; submitting it again with resume=true in ${restart_delay}s" >&2
  extra=(--run-config "resume=true")
  sleep "$restart_delay"
done
