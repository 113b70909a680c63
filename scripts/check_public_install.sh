#!/usr/bin/env bash
# Resolve the README's installs against the public package index alone: no local wheel directory
# (find-links), no local index, no pip configuration file, no constraint cap of this machine. A dry run:
# pip reads the wheels' metadata only (PEP 658), nothing multi-GB is downloaded.
#
#   bash scripts/check_public_install.sh PYTHON CONSTRAINTS EXTRA [EXTRA ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$1; CONSTRAINTS=$2; shift 2
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
"$PY" -m venv "$TMP/venv"
for extra in "$@"; do
  echo "resolve (public index only): $("$PY" -c 'import sys; print("python%d.%d" % sys.version_info[:2])') -c $CONSTRAINTS -e '.[$extra]'"
  env -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
    "$TMP/venv/bin/pip" install --dry-run -q --report "$TMP/report.json" -c "$CONSTRAINTS" -e ".[$extra]"
  "$TMP/venv/bin/python" - "$TMP/report.json" <<'PYEOF'
import json, sys
pkgs = {p["metadata"]["name"]: p["metadata"]["version"] for p in json.load(open(sys.argv[1]))["install"]}
print("  ok:", len(pkgs), "packages;", ", ".join(f"{n}=={pkgs[n]}" for n in ("torch", "triton", "megatron-core") if n in pkgs))
PYEOF
done
