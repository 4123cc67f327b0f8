#!/usr/bin/env bash
# tcmalloc, which vLLM's CPU documentation asks to preload: Debian's libtcmalloc-minimal4, installed
# when missing where apt-get can run (as root). Without it vLLM still runs, and the bench's JSON
# says it ran without (its "mode").
set -euo pipefail
for dir in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib; do
    if [ -e "$dir/libtcmalloc_minimal.so.4" ] || [ -e "$dir/libtcmalloc.so.4" ]; then
        exit 0
    fi
done
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing libtcmalloc-minimal4 (vLLM's CPU build preloads it)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
else
    echo "note: no tcmalloc here and no apt-get as root to install it; vLLM runs without it" >&2
fi
