#!/usr/bin/env bash
# The shipped Prometheus rules (ops/prometheus): promtool checks them and runs their unit tests
# (series fixtures: every alert fires on trouble and stays quiet when healthy), every alert has
# its runbook (a `#### <AlertName>` section in docs/operating.md), and the Grafana dashboard is
# JSON with queries. The live check (a real Prometheus scraping a real Envoy) is
# tests/it/prometheus.rs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh prometheus
promtool check rules ops/prometheus/idemgate.rules.yml
promtool test rules ops/prometheus/idemgate.test.yml
python3 - <<'PY'
import json, re, sys
rules = open("ops/prometheus/idemgate.rules.yml").read()
doc = open("docs/operating.md").read()
alerts = re.findall(r"^  - alert: (\w+)$", rules, re.M)
tests = open("ops/prometheus/idemgate.test.yml").read()
bad = []
for a in alerts:
    if not re.search(rf"^#### {a}$", doc, re.M):
        bad.append(f"{a}: no '#### {a}' runbook section in docs/operating.md")
    if f"runbook: docs/operating.md#{a.lower()}" not in rules:
        bad.append(f"{a}: its runbook annotation does not point at docs/operating.md#{a.lower()}")
    if not re.search(rf"alertname: {a}\n    exp_alerts:\n    - ", tests):
        bad.append(f"{a}: ops/prometheus/idemgate.test.yml never shows it firing")
dash = json.load(open("ops/grafana/idemgate.json"))
exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
if len(exprs) < 20 or not all(exprs):
    bad.append(f"ops/grafana/idemgate.json: {len(exprs)} queries")
if bad:
    sys.exit("check-ops:\n  " + "\n  ".join(bad))
print(f"check-ops: {len(alerts)} alerts, each with a runbook and a firing test; {len(exprs)} dashboard queries")
PY
