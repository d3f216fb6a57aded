#!/usr/bin/env bash
# What `make test` needs beside the venv, from Debian's packages (the tests start them on
# loopback themselves): redis-server, chromium for the Prefect UI picture test, and util-linux's
# setpriv/prlimit (the standby test drops a capability with them). Installs
# only what is missing, so it is quick and offline on a machine that has them.
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
{ command -v setpriv && command -v prlimit; } >/dev/null 2>&1 || missing+=(util-linux)
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing ${missing[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq "${missing[@]}" >/dev/null
