#!/bin/sh
# Installs what bench/run.py needs besides meshjobs itself: the peers' Python packages (Huey,
# Celery, RQ and the Redis client) and a redis-server binary. Safe to run again: it skips what
# is there already.
set -eu

if ! python3 -c "import huey, celery, rq, redis" 2>/dev/null; then
    python3 -m pip install --quiet huey celery rq redis
fi

if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup.sh: redis-server is missing; run this script as root to apt-get install it" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    # The package starts a system redis on 6379; the benchmark starts its own on another port.
    if command -v systemctl >/dev/null 2>&1; then
        systemctl disable --now redis-server >/dev/null 2>&1 || true
    fi
fi

python3 -c "import huey, celery, rq, redis" && command -v redis-server >/dev/null && echo "setup.sh: ready"
