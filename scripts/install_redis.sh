#!/usr/bin/env bash
# Installs the Redis server the remote-tier tests and scripts/bench_remote.py start (Redis 7+,
# cluster mode; they start and stop their own processes on free loopback ports). Idempotent:
# nothing happens when `redis-server` (7 or newer) and `redis-cli` are on PATH already.
# Debian/Ubuntu with root: apt's redis-server package (the service is not started: a
# policy-rc.d that refuses is put in place for the install if none exists).
set -euo pipefail
have() {
  command -v redis-server >/dev/null && command -v redis-cli >/dev/null || return 1
  local major
  major=$(redis-server --version | sed -n 's/.* v=\([0-9]*\)\..*/\1/p')
  [ "${major:-0}" -ge 7 ]
}
if have; then exit 0; fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "install_redis: need redis-server >= 7 and redis-cli on PATH; install them (e.g." \
       "apt-get install redis-server, or Valkey 8) or run this script as root on Debian" >&2
  exit 1
fi
created=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  created=1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends redis-server >/dev/null \
  || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends redis-server >/dev/null; }
[ -n "$created" ] && rm -f /usr/sbin/policy-rc.d
have || { echo "install_redis: redis-server >= 7 still missing after apt-get" >&2; exit 1; }
