#!/usr/bin/env bash
# Certificates for a local TLS test of the deployment: a CA, a SuperLink certificate whose
# subject-alternative names cover 127.0.0.1 and localhost (add yours with EXTRA_SAN, e.g.
# EXTRA_SAN="IP:192.168.1.10,DNS:server.lan"), and one ECDSA key pair per SuperNode for
# authentication. Not for production: the CA key sits next to everything else.
# Usage: scripts/generate_certs.sh DIR [NUM_NODES]
set -euo pipefail
dir="${1:?usage: generate_certs.sh DIR [NUM_NODES]}"; nodes="${2:-3}"
mkdir -p "$dir"; cd "$dir"
san="IP:127.0.0.1,DNS:localhost${EXTRA_SAN:+,$EXTRA_SAN}"
openssl genrsa -out ca.key 2048 2>/dev/null
openssl req -x509 -new -nodes -key ca.key -sha256 -days 30 -subj "/CN=fedsim-test-ca" -out ca.crt
openssl genrsa -out server.key 2048 2>/dev/null
openssl req -new -key server.key -subj "/CN=fedsim-superlink" -out server.csr
printf "subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n" "$san" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.pem -days 30 -sha256 -extfile server.ext 2>/dev/null
for ((i = 0; i < nodes; i++)); do
  rm -f "node${i}_key" "node${i}_key.pub"
  ssh-keygen -q -t ecdsa -b 384 -N "" -f "node${i}_key"
done
echo "wrote $(pwd): ca.crt server.pem server.key node{0..$((nodes - 1))}_key(.pub)"
