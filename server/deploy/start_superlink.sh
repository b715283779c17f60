#!/usr/bin/env bash
# Start the SuperLink on the server host: TLS and SuperNode authentication on (Flower 1.42).
#
# Usage: start_superlink.sh --certs DIR [--host ADDR] [--port PORT] [--database FILE]
#                           [--insecure] [-- EXTRA flower-superlink ARGS]
#
#   --certs DIR      ca.crt, server.crt, server.key from make_certs.sh
#   --host ADDR      address to listen on (default 127.0.0.1: this host only). Flower 1.42
#                    serves the Fleet API (SuperNodes), the Control API (`flwr run`, `flwr
#                    supernode register`, `flwr ls`: no account authentication in the open
#                    source SuperLink) and the Runtime API on ONE address: expose only the
#                    Fleet API to client hosts with start_proxy.sh. Any other address warns.
#   --port PORT      the one port of the Fleet, Control and Runtime APIs (default 9093)
#   --database FILE  keep the SuperLink's state (registered SuperNodes, runs, messages) in
#                    FILE, across restarts of the SuperLink; default: in memory (faster, and
#                    this project's resume uses its own checkpoint, not Flower's state), so a
#                    restarted SuperLink needs every SuperNode registered again
#   --insecure       NO TLS and NO SuperNode authentication (Flower cannot authenticate
#                    SuperNodes without TLS): anyone who reaches the port can join and read
#                    the model. Only for throw-away experiments on a trusted network.
#
# Only SuperNodes whose public key was registered with `flwr supernode register` may connect.
# The app's Python dependencies must be installed on this host (pip install .); Flower's
# per-run `uv sync` is disabled. The ServerApp runs in this script's working directory, so
# a relative results-dir lands here. The script replaces itself with flower-superlink (exec).
set -euo pipefail

certs="" host="127.0.0.1" port=9093 database="" insecure=0 extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --certs) certs="$2"; shift 2 ;;
    --host) host="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --database) database="$2"; shift 2 ;;
    --insecure) insecure=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "start_superlink.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$port" =~ ^[0-9]+$ ]] || { echo "start_superlink.sh: --port must be a number, got $port" >&2; exit 2; }
database="${database:-:flwr-in-memory:}"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
case "$host" in
  127.*|localhost|::1) ;;
  *) cat >&2 <<EOF
WARNING: start_superlink.sh --host $host: the Control API (register SuperNodes, submit runs that
WARNING: execute code on this host) is open to everyone who reaches $host:$port. Keep the default
WARNING: (127.0.0.1) and expose only the Fleet API with start_proxy.sh (see docs/DEPLOY.md).
EOF
  ;;
esac

args=(--host "$host" --port "$port" --database "$database" --disable-runtime-dependency-installation)
if [[ $insecure -eq 1 ]]; then
  cat >&2 <<'EOF'
WARNING: start_superlink.sh --insecure: TLS and SuperNode authentication are OFF.
WARNING: traffic (models, configs) is unencrypted and ANY SuperNode that reaches this port can join.
EOF
  args=(--insecure "${args[@]}")
else
  [[ -n "$certs" ]] || { echo "start_superlink.sh: --certs DIR is required (or --insecure, not recommended)" >&2; exit 2; }
  for f in ca.crt server.crt server.key; do
    [[ -f "$certs/$f" ]] || { echo "start_superlink.sh: $certs/$f is missing: run make_certs.sh first" >&2; exit 2; }
  done
  args=(--ssl-ca-certfile "$certs/ca.crt" --ssl-certfile "$certs/server.crt" --ssl-keyfile "$certs/server.key"
        --enable-supernode-auth "${args[@]}")
fi
exec "${FLWR_BIN_DIR:+$FLWR_BIN_DIR/}flower-superlink" "${args[@]}" "${extra[@]}"
