#!/usr/bin/env bash
# Installs what the tests and the demo need from Debian: Prometheus, Alertmanager (promtool comes with
# Prometheus), VictoriaMetrics with vmagent and vmalert (docs/scaling.md, tests/e2e/test_victoria_metrics.py).
# Does nothing when they are there; without root and sudo it says what to install.
set -euo pipefail
missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v promtool >/dev/null || missing+=(prometheus)
command -v prometheus-alertmanager >/dev/null || command -v alertmanager >/dev/null || missing+=(prometheus-alertmanager)
for binary in victoria-metrics vmagent vmalert; do
  command -v "$binary" >/dev/null || { missing+=(victoria-metrics); break; }
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else
  echo "install-system-deps: please install: ${missing[*]} (apt-get install -y ${missing[*]})" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq "${missing[@]}" >/dev/null
