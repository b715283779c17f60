#!/usr/bin/env bash
# Start the reverse proxy (nginx) that exposes ONLY the SuperLink's Fleet API to client hosts.
#
# Usage: start_proxy.sh --certs DIR [--listen ADDR:PORT] [--upstream HOST:PORT]
#                       [--run-dir DIR] [--max-body SIZE] [--check]
#
#   --certs DIR          ca.crt, server.crt, server.key from make_certs.sh (the proxy presents
#                        server.crt to SuperNodes and checks the SuperLink's against ca.crt)
#   --listen ADDR:PORT   where SuperNodes connect (default 0.0.0.0:9092; the address must be in
#                        server.crt's subjectAltName: make_certs.sh -s)
#   --upstream HOST:PORT the SuperLink, started with start_superlink.sh on loopback (default
#                        127.0.0.1:9093)
#   --run-dir DIR        the rendered nginx.conf, pid file, access.log, temp folders (default
#                        $XDG_RUNTIME_DIR/celgc-proxy or /tmp/celgc-proxy-$USER)
#   --max-body SIZE      largest request body (default 64m; Flower sends arrays in 5 MiB chunks)
#   --check              render the configuration, test it (nginx -t) and exit
#
# Only POST /v1/fleet/<call> is passed on (SuperNodes: activate, heartbeat, pull/push messages
# and objects, get-run, get-fab); the Control API (/v1/control/: `flwr run`, `flwr supernode
# register`, `flwr ls`) and the Runtime API (/v1/runtime/) answer 404 from here. Registration
# stays an operator action on the server host. The script renders nginx-fleet.conf (next to it)
# into --run-dir and replaces itself with nginx in the foreground (exec); SIGTERM stops it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
certs="" listen="0.0.0.0:9092" upstream="127.0.0.1:9093" max_body="64m" check=0
run_dir="${XDG_RUNTIME_DIR:+$XDG_RUNTIME_DIR/celgc-proxy}"
run_dir="${run_dir:-/tmp/celgc-proxy-${USER:-$(id -u)}}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --certs) certs="$2"; shift 2 ;;
    --listen) listen="$2"; shift 2 ;;
    --upstream) upstream="$2"; shift 2 ;;
    --run-dir) run_dir="$2"; shift 2 ;;
    --max-body) max_body="$2"; shift 2 ;;
    --check) check=1; shift ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "start_proxy.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "start_proxy.sh: $*" >&2; exit 2; }
[[ -n "$certs" ]] || die "--certs DIR is required (ca.crt, server.crt, server.key from make_certs.sh)"
for f in ca.crt server.crt server.key; do
  [[ -f "$certs/$f" ]] || die "$certs/$f is missing: run make_certs.sh first"
done
addr_re='^([0-9]+\.[0-9]+\.[0-9]+\.[0-9]+|\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):[0-9]+$'
[[ "$listen" =~ $addr_re ]] || die "--listen must be ADDR:PORT, got $listen"
[[ "$upstream" =~ $addr_re ]] || die "--upstream must be HOST:PORT, got $upstream"
case "${upstream%:*}" in
  127.*|localhost|\[::1\]) ;;
  *) echo "start_proxy.sh: WARNING: --upstream $upstream is not a loopback address: the SuperLink's" \
          "Control API is then reachable without this proxy from wherever that address is." >&2 ;;
esac
[[ "$max_body" =~ ^[0-9]+[kKmMgG]?$ ]] || die "--max-body must be a size like 64m, got $max_body"
certs="$(cd "$certs" && pwd)"
mkdir -p "$run_dir"
run_dir="$(cd "$run_dir" && pwd)"
for p in "$certs" "$run_dir"; do  # nginx.conf has no quoting: refuse what would break it
  [[ "$p" != *[\"\'\;\{\}\$\\[:space:]]* ]] || die "path must not contain spaces, quotes, ; { } \$ or \\: $p"
done
nginx="$(command -v nginx || true)"
[[ -z "$nginx" && -x /usr/sbin/nginx ]] && nginx=/usr/sbin/nginx
[[ -n "$nginx" ]] || { echo "start_proxy.sh: nginx is not installed (Debian/Ubuntu: apt-get install nginx)" >&2; exit 1; }

conf="$run_dir/nginx.conf"
sed -e "s|@RUN_DIR@|$run_dir|g" -e "s|@CERTS@|$certs|g" -e "s|@LISTEN@|$listen|g" \
    -e "s|@UPSTREAM@|$upstream|g" -e "s|@MAX_BODY@|$max_body|g" "$here/nginx-fleet.conf" > "$conf"
if [[ $check -eq 1 ]]; then
  exec "$nginx" -e stderr -p "$run_dir" -c "$conf" -t
fi
echo "start_proxy.sh: Fleet API only, https://$listen -> https://$upstream (config $conf)" >&2
exec "$nginx" -e stderr -p "$run_dir" -c "$conf"
