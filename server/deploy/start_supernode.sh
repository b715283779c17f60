#!/usr/bin/env bash
# Start one SuperNode on a client host: TLS + SuperNode authentication (Flower 1.42).
#
# Usage: start_supernode.sh --superlink HOST:PORT --ca FILE --key FILE
#                           (--partition I --num-partitions N | --local-data DIR)
#                           [--port PORT] [--rejoin-retries K] [--rejoin-delay S]
#                           [--isolation warm|subprocess] [--threads N|auto]
#                           [--superexec-auth-secret-file FILE] [--insecure] [-- EXTRA flower-supernode ARGS]
#
#   --superlink HOST:PORT   the SuperLink (a name or IP in its certificate's subjectAltName)
#   --ca FILE               the deployment's ca.crt
#   --key FILE              this host's private key supernode-I (its .pub must be registered)
#   --partition I --num-partitions N
#                           simulated partitions: the host computes partition I of N from
#                           the shared seed, without coordination
#   --local-data DIR        this host's own data instead (DIR/<task>.npz, see docs/DEPLOY.md);
#                           add --partition I to seed its minibatch stream like partition I
#   --port PORT             local port of the SuperNode's ClientApp API (default 9094; two
#                           SuperNodes on one host need two ports)
#   --rejoin-retries K      if the SuperLink refuses the connection (it still counts a crashed
#                           predecessor as online: up to 2 missed 30 s heartbeats), try again
#                           up to K times, --rejoin-delay S seconds apart (default 0 / 15)
#   --isolation MODE        warm (default): the SuperNode runs with Flower's --isolation process
#                           and this project's warm runner (client/warm_runner.py) runs
#                           its ClientApps from warm processes (flwr, torch, the app and the
#                           task's data loaded once a run; see docs/DEPLOY.md for what it
#                           isolates); subprocess: Flower's stock path, a new flwr-clientapp
#                           process per message
#   --threads N|auto        torch threads of a ClientApp (default auto: the host's cores divided
#                           by the SuperNodes running on it, at least 1, counted at the node's
#                           first message of a run and kept for the run: results depend on it)
#   --superexec-auth-secret-file FILE
#                           warm: the SuperNode's SuperExec secret, given to it and to the runner: only
#                           a process holding it acquires the node's tasks (default: a fresh random one
#                           per start, readable by this user only, removed when the script ends)
#   --insecure              no TLS, no authentication (needs a SuperLink started --insecure)
set -euo pipefail

superlink="" ca="" key="" partition="" num="" local_data="" port=9094 retries=0 delay=15 insecure=0 extra=()
isolation=warm threads=auto secret=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --superlink) superlink="$2"; shift 2 ;;
    --ca) ca="$2"; shift 2 ;;
    --key) key="$2"; shift 2 ;;
    --partition) partition="$2"; shift 2 ;;
    --num-partitions) num="$2"; shift 2 ;;
    --local-data) local_data="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --rejoin-retries) retries="$2"; shift 2 ;;
    --rejoin-delay) delay="$2"; shift 2 ;;
    --isolation) isolation="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --superexec-auth-secret-file) secret="$2"; shift 2 ;;
    --insecure) insecure=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,36p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "start_supernode.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "start_supernode.sh: $*" >&2; exit 2; }
[[ -n "$superlink" ]] || die "--superlink HOST:PORT is required"
for v in port retries delay; do [[ "${!v}" =~ ^[0-9]+$ ]] || die "--${v/retries/rejoin-retries} must be an integer >= 0"; done
[[ -z "$partition" || "$partition" =~ ^[0-9]+$ ]] || die "--partition must be an integer >= 0, got $partition"
[[ "$isolation" == warm || "$isolation" == subprocess ]] || die "--isolation must be warm or subprocess, got $isolation"
[[ "$threads" == auto || "$threads" =~ ^[1-9][0-9]*$ ]] || die "--threads must be an integer >= 1 or auto, got $threads"
[[ -z "$secret" || ( $isolation == warm && -s "$secret" ) ]] || die "--superexec-auth-secret-file needs --isolation warm and a non-empty file, got $secret"

node_config=""
if [[ -n "$local_data" ]]; then
  [[ -z "$num" ]] || die "--local-data and --num-partitions exclude each other"
  [[ -d "$local_data" ]] || die "--local-data $local_data is not a directory"
  [[ "$local_data" != *[\"\'[:space:]]* ]] || die "--local-data must not contain quotes or spaces"
  node_config="local-data=\"$(cd "$local_data" && pwd)\""
  [[ -z "$partition" ]] || node_config+=" partition-id=$partition"
else
  [[ -n "$partition" && "$num" =~ ^[1-9][0-9]*$ ]] || die "give --partition I --num-partitions N, or --local-data DIR"
  (( partition < num )) || die "--partition must be < --num-partitions ($num), got $partition"
  node_config="partition-id=$partition num-partitions=$num"
fi

export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export CELGC_TORCH_THREADS="$threads"  # read by the ClientApp (client/app.py), on either isolation
args=(--superlink "$superlink" --port "$port" --node-config "$node_config")
if [[ $insecure -eq 1 ]]; then
  echo "WARNING: start_supernode.sh --insecure: no TLS and no SuperNode authentication." >&2
  args=(--insecure "${args[@]}")
else
  [[ -f "$ca" ]] || die "--ca FILE (the deployment's ca.crt) is required (or --insecure, not recommended)"
  [[ -f "$key" ]] || die "--key FILE (this host's supernode private key) is required"
  args=(--root-certificates "$ca" --auth-supernode-private-key "$key" "${args[@]}")
fi
bin="${FLWR_BIN_DIR:+$FLWR_BIN_DIR/}flower-supernode"
if [[ $isolation == subprocess && $retries -eq 0 ]]; then
  exec "$bin" "${args[@]}" "${extra[@]}"
fi
# the warm runner runs with the interpreter of the environment flower-supernode belongs to
python="$(dirname "$(command -v "$bin")")/python"
[[ -x "$python" ]] || python=python3
runner_py="$(cd "$(dirname "$0")/../.." && pwd)/client/warm_runner.py"  # run as a file: it imports nothing of the project
[[ $isolation == subprocess || -f "$runner_py" ]] || die "--isolation warm needs $runner_py (this project's checkout)"
secret_dir=""
trap '[[ -z "$secret_dir" ]] || rm -rf "$secret_dir"' EXIT
if [[ $isolation == warm && -z "$secret" ]]; then  # a fresh SuperExec secret: only this node's runner acquires its tasks
  secret_dir="$(mktemp -d "${TMPDIR:-/tmp}/celgc-supernode.XXXXXX")"
  secret="$secret_dir/superexec-secret"
  (umask 077 && head -c 32 /dev/urandom > "$secret")
fi

# One SuperNode (and, warm, its runner) at a time; flower-supernode exits 1 on errors (e.g.
# "Failed to activate SuperNode"), 0 or 128+N when asked to stop: only 1 is retried.
node="" runner=""
stop() {  # SIGTERM to the given processes, SIGKILL to those still there after 10 s
  local pid left
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  for ((i = 0; i < 100; i++)); do
    left=0; for pid in "$@"; do kill -0 "$pid" 2>/dev/null && left=1; done
    (( left )) || break
    sleep 0.1
  done
  for pid in "$@"; do kill -KILL "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
}
stop_all() {
  local pids=()
  [[ -n "$node" ]] && pids+=("$node")
  [[ -n "$runner" ]] && pids+=("$runner")
  (( ${#pids[@]} )) && stop "${pids[@]}"
  return 0
}
trap 'stop_all; exit 143' TERM
trap 'stop_all; exit 130' INT
for ((attempt = 0; ; attempt++)); do
  if [[ $isolation == warm ]]; then
    "$bin" --isolation process --superexec-auth-secret-file "$secret" "${args[@]}" "${extra[@]}" & node=$!
    "$python" "$runner_py" --runtime-api-address "127.0.0.1:$port" --insecure --parent-pid "$node" \
      --superexec-auth-secret-file "$secret" & runner=$!
  else
    "$bin" "${args[@]}" "${extra[@]}" & node=$!
  fi
  set +e; wait "$node"; rc=$?; set -e
  node=""
  if [[ -n "$runner" ]]; then stop "$runner"; runner=""; fi
  if [[ $rc -ne 1 || $attempt -ge $retries ]]; then exit "$rc"; fi
  echo "start_supernode.sh: SuperLink refused the connection; retry $((attempt + 1))/$retries in ${delay}s" >&2
  sleep "$delay"
done
