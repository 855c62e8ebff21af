#!/usr/bin/env bash
# Debian packages the tests need, each installed only when its binary is missing, only where apt-get and
# root are available (apt-get update runs once, for all of them):
#   postgresql               initdb, pg_ctl for the throwaway cluster (/usr/lib/postgresql/<major>/bin/)
#   prometheus               promtool (/usr/bin/promtool): checks and unit-tests infra/prometheus/
#   prometheus-alertmanager  amtool (/usr/bin/amtool): checks infra/alertmanager/alertmanager.yml
#   g++ pkg-config libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libxxhash-dev
#                            builds benchmarks/native_reference (C++ gRPC front end) for its test and the bench
# Both Prometheus packages also ship a daemon, which a systemd host enables; the tests use only the tools
# (`systemctl disable --now prometheus prometheus-alertmanager` stops them).
set -euo pipefail
have_pg() {
  command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null
}
have_promtool() { command -v promtool >/dev/null 2>&1; }
have_amtool() { command -v amtool >/dev/null 2>&1; }
have_grpcpp() {
  command -v g++ >/dev/null 2>&1 && command -v protoc >/dev/null 2>&1 && command -v grpc_cpp_plugin >/dev/null 2>&1 &&
    pkg-config --exists grpc++ protobuf libxxhash 2>/dev/null
}

missing=()
have_pg || missing+=(postgresql)
have_promtool || missing+=(prometheus)
have_amtool || missing+=(prometheus-alertmanager)
have_grpcpp || missing+=(g++ pkg-config libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libxxhash-dev)
if [ "${#missing[@]}" -eq 0 ]; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "missing tools (initdb, promtool, amtool, grpc++ build tools): install the Debian packages: ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
have_pg && have_promtool && have_amtool && have_grpcpp
