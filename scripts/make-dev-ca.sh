#!/usr/bin/env bash
# A local development CA and certificates for a kvpager stack on this machine.
#
#   bash scripts/make-dev-ca.sh [DIR]        (default DIR: ./dev-certs)
#
# Writes into DIR (keys are mode 600):
#   ca.crt  ca.key          the CA (trust root: --tls-ca)
#   server.crt server.key   every service's certificate: SANs localhost, 127.0.0.1, ::1;
#                           serverAuth + clientAuth, so services use it both to serve
#                           (--tls-cert/--tls-key) and for mTLS to each other
#                           (--tls-client-cert/--tls-client-key)
#   client.crt client.key   a client certificate (clientAuth) for kvpager generate / blocks
#
# Existing files are kept (delete DIR to start over). For development and tests
# only: a real deployment takes its certificates from its own PKI.
set -euo pipefail

DIR="${1:-dev-certs}"
DAYS="${KVPAGER_CERT_DAYS:-825}"
HOSTS="${KVPAGER_CERT_HOSTS:-DNS:localhost,IP:127.0.0.1,IP:::1}"
command -v openssl >/dev/null || { echo "make-dev-ca.sh: openssl not found" >&2; exit 1; }
mkdir -p "$DIR"
cd "$DIR"
umask 077

if [[ ! -f ca.crt ]]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 -days "$DAYS" \
    -subj "/CN=kvpager dev CA" -keyout ca.key -out ca.crt \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

issue() {  # name CN extendedKeyUsage [SANs]
  local name="$1" cn="$2" eku="$3" san="${4:-}"
  [[ -f "$name.crt" ]] && return 0
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 \
    -subj "/CN=$cn" -keyout "$name.key" -out "$name.csr" 2>/dev/null
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -n "$san" ]] && echo "subjectAltName=$san"
  } > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days "$DAYS" -sha256 \
    -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}

issue server localhost "serverAuth,clientAuth" "$HOSTS"
issue client kvpager-client "clientAuth"
rm -f ca.srl
chmod 600 ./*.key
chmod 644 ./*.crt
echo "kvpager dev certificates in $(pwd):"
ls -1 "$(pwd)"
