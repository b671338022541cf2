#!/usr/bin/env bash
# Makes sure a redis-server binary exists: the test suite starts its own server on a loopback port.
set -u
if command -v redis-server >/dev/null 2>&1 || [ -n "${TIERCACHE_REDIS_SERVER:-}" ]; then
  exit 0
fi
echo "tiercache setup: redis-server not found; trying to install it with apt-get"
if command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null && exit 0
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null && exit 0
  fi
fi
cat >&2 <<'MSG'
tiercache setup: redis-server is required by the test suite and could not be installed automatically.
Install it, then run the command again:
  Debian/Ubuntu:  sudo apt-get install redis-server
  macOS:          brew install redis
or point TIERCACHE_REDIS_SERVER at an existing redis-server binary.
MSG
exit 1
