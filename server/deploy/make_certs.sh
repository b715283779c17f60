#!/usr/bin/env bash
# Create the credentials of a secure CELGC deployment (Flower 1.42):
#
#   DIR/ca.crt, ca.key             a private certificate authority (copy ca.crt to every host)
#   DIR/server.crt, server.key     the SuperLink's TLS certificate, signed by the CA, with a
#                                  subjectAltName for every --server-host (plus localhost and
#                                  127.0.0.1: the SuperLink's own ServerApp connects locally)
#   DIR/supernode-I, -I.pub        one EC P-384 key pair per SuperNode (OpenSSH format, what
#                                  `flower-supernode --auth-supernode-private-key` and
#                                  `flwr supernode register` read)
#
# Usage: make_certs.sh [-o DIR] -s HOST_OR_IP [-s ...] [-n NUM_SUPERNODES] [--days N] [--force]
#
# DIR defaults to ${XDG_CONFIG_HOME:-~/.config}/celgc/certs, outside any working tree. A DIR
# inside a git working tree is refused unless git ignores it (this repository ignores /certs/):
# private keys must never be committable.
#
# Existing files are kept, so the script can be re-run to add SuperNode keys (-n larger)
# without invalidating what is deployed; --force recreates the CA and server certificate.
# Private keys are created with mode 600: ca.key stays with the operator, server.key on the
# server host, supernode-I on client host I only.
set -euo pipefail

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

out="" nodes=0 days=825 force=0 hosts=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -o|--out) out="$2"; shift 2 ;;
    -s|--server-host) hosts+=("$2"); shift 2 ;;
    -n|--supernodes) nodes="$2"; shift 2 ;;
    --days) days="$2"; shift 2 ;;
    --force) force=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "make_certs.sh: unknown argument $1" >&2; usage 2 ;;
  esac
done
out="${out:-${XDG_CONFIG_HOME:-$HOME/.config}/celgc/certs}"
[[ "$nodes" =~ ^[0-9]+$ ]] || { echo "make_certs.sh: -n must be an integer >= 0, got $nodes" >&2; exit 2; }
[[ "$days" =~ ^[1-9][0-9]*$ ]] || { echo "make_certs.sh: --days must be an integer >= 1, got $days" >&2; exit 2; }
command -v openssl >/dev/null || { echo "make_certs.sh: openssl is required" >&2; exit 1; }

# Refuse a DIR that git would commit: its nearest existing folder is in a work tree, and
# DIR/ca.key is not ignored there (or is tracked).
if command -v git >/dev/null; then
  case "$out" in /*) abs="$out" ;; *) abs="$PWD/$out" ;; esac
  anc="$abs"
  while [[ ! -d "$anc" ]]; do anc="$(dirname "$anc")"; done
  if [[ "$(git -C "$anc" rev-parse --is-inside-work-tree 2>/dev/null)" == true ]]; then
    rel="${abs#"$anc"}"; rel="${rel#/}"
    if ! git -C "$anc" check-ignore -q -- "${rel:+$rel/}ca.key" 2>/dev/null; then
      echo "make_certs.sh: $out is inside the git working tree $(git -C "$anc" rev-parse --show-toplevel)" \
           "and not ignored: private keys there could be committed. Use a folder outside it (default" \
           "\${XDG_CONFIG_HOME:-~/.config}/celgc/certs) or add it to .gitignore." >&2
      exit 2
    fi
  fi
fi

umask 077
mkdir -p "$out"

# subjectAltName: localhost and 127.0.0.1 always, then every --server-host (IP or DNS name)
san="DNS:localhost,IP:127.0.0.1"
for h in "${hosts[@]}"; do
  [[ "$h" == localhost || "$h" == 127.0.0.1 ]] && continue
  if [[ "$h" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ || "$h" == *:* ]]; then san+=",IP:$h"; else san+=",DNS:$h"; fi
done

if [[ $force -eq 1 || ! -f "$out/ca.crt" || ! -f "$out/ca.key" ]]; then
  openssl ecparam -name secp384r1 -genkey -noout -out "$out/ca.key"
  openssl req -x509 -new -key "$out/ca.key" -sha384 -days "$days" -subj "/CN=CELGC deployment CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$out/ca.crt" 2>/dev/null
  force=1  # a new CA invalidates the old server certificate
  echo "created $out/ca.crt (CA)"
fi

if [[ $force -eq 1 || ! -f "$out/server.crt" || ! -f "$out/server.key" ]]; then
  openssl ecparam -name secp384r1 -genkey -noout -out "$out/server.key"
  openssl req -new -key "$out/server.key" -subj "/CN=${hosts[0]:-localhost}" -out "$out/server.csr" 2>/dev/null
  printf '%s\n' "subjectAltName=$san" "basicConstraints=critical,CA:FALSE" \
    "keyUsage=critical,digitalSignature,keyEncipherment" "extendedKeyUsage=serverAuth" > "$out/server.ext"
  openssl x509 -req -in "$out/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial \
    -days "$days" -sha384 -extfile "$out/server.ext" -out "$out/server.crt" 2>/dev/null
  rm -f "$out/server.csr" "$out/server.ext" "$out/ca.srl"
  echo "created $out/server.crt for $san"
fi

keygen() {  # $1: path of the private key; writes $1 and $1.pub (OpenSSH, ECDSA P-384)
  if command -v ssh-keygen >/dev/null; then
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "$(basename "$1")" -f "$1"
  else  # the Python `cryptography` package ships with flwr
    python3 - "$1" <<'EOF'
import os, sys
from cryptography.hazmat.primitives import serialization as s
from cryptography.hazmat.primitives.asymmetric import ec
key = ec.generate_private_key(ec.SECP384R1())
path = sys.argv[1]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, key.private_bytes(s.Encoding.PEM, s.PrivateFormat.OpenSSH, s.NoEncryption()))
os.close(fd)
pub = key.public_key().public_bytes(s.Encoding.OpenSSH, s.PublicFormat.OpenSSH)
open(path + ".pub", "wb").write(pub + b" " + os.path.basename(path).encode() + b"\n")
EOF
  fi
}

for ((i = 0; i < nodes; i++)); do
  key="$out/supernode-$i"
  if [[ ! -f "$key" ]]; then
    keygen "$key"
    echo "created $key (private: client host $i only) and $key.pub (register it on the SuperLink)"
  fi
done
chmod 644 "$out/ca.crt" "$out/server.crt" "$out"/supernode-*.pub 2>/dev/null || true
