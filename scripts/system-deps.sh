#!/usr/bin/env bash
# Debian packages the tests need: PostgreSQL's server binaries (initdb, pg_ctl) for the throwaway
# cluster. Installed only when missing, only where apt-get and root are available.
set -euo pipefail
have_pg() {
  command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null
}
if have_pg; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "PostgreSQL server binaries (initdb) are missing: install the 'postgresql' package" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends postgresql >/dev/null
have_pg
