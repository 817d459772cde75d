#!/usr/bin/env bash
# Generate the stack's two secrets for `kubectl apply -k deploy/k8s` (its secretGenerator
# turns them into the Secret "pd-secrets", mounted read-only at /run/secrets/pd, mode 0400):
#
#   decode-api-key  the decode servers' HTTP API key (PD_DECODE_API_KEY_FILE), sent by the
#                   router (PD_ROUTER_DECODE_API_KEY_FILE)
#   kv-secret       the KV control channel's shared secret (PD_DECODE_KV_SECRET_FILE, the
#                   prefill connector's PD_PREFILL_KV_SECRET_FILE)
#
#   deploy/k8s/make-secrets.sh [DIR]     (default: deploy/k8s/secrets, git-ignored)
#
# An existing file is kept (running pods hold its value); delete it to rotate, then re-apply.
set -euo pipefail
dir=${1:-$(cd "$(dirname "$0")" && pwd)/secrets}
umask 077
mkdir -p "$dir"
chmod 700 "$dir"
for name in decode-api-key kv-secret; do
    if [[ ! -s $dir/$name ]]; then
        python3 -c 'import secrets; print(secrets.token_hex(32))' > "$dir/$name.tmp"
        mv "$dir/$name.tmp" "$dir/$name"
        echo "make-secrets.sh: wrote $dir/$name" >&2
    fi
done
