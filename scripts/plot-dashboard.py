#!/usr/bin/env python3
"""Plots the queries of ops/grafana/idemgate.json from a Prometheus, as the dashboard lays them
out (one chart per panel, one line per series), into an SVG: no Grafana and no plotting library
needed. tests/it/prometheus.rs runs it on the Prometheus it started (target/prometheus/dashboard.svg);
docs/dashboard.svg is one such run.

    scripts/plot-dashboard.py PROMETHEUS_URL START END OUT.svg [RATE_INTERVAL]
"""
import json, math, os, sys, urllib.parse, urllib.request
from xml.sax.saxutils import escape

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"]
W, H, PAD = 520, 230, 44


def query_range(url, expr, start, end, step):
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{q}", timeout=30) as r:
        data = json.load(r)
    if data.get("status") != "success":
        raise SystemExit(f"{expr}: {data}")
    return data["data"]["result"]


def legend(fmt, labels):
    out = fmt
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    return out.replace("{{", "").replace("}}", "")


def chart(x0, y0, title, lines, start, end):
    ys = [v for _, pts in lines for _, v in pts if math.isfinite(v)]
    top = max(ys) if ys else 1.0
    top = top * 1.1 if top > 0 else 1.0
    out = [f'<g transform="translate({x0},{y0})">',
           f'<rect x="0" y="0" width="{W - 10}" height="{H - 10}" fill="#fff" stroke="#ccc"/>',
           f'<text x="8" y="16" font-weight="bold">{escape(title)}</text>',
           f'<text x="4" y="{PAD - 6}" fill="#666">{top:.3g}</text>',
           f'<text x="4" y="{H - 54}" fill="#666">0</text>']
    pw, ph = W - 10 - PAD - 8, H - 10 - PAD - 40
    out.append(f'<line x1="{PAD}" y1="{PAD + ph}" x2="{PAD + pw}" y2="{PAD + ph}" stroke="#999"/>')
    for i, (name, pts) in enumerate(lines):
        c = COLORS[i % len(COLORS)]
        xy = [(PAD + pw * (t - start) / max(end - start, 1), PAD + ph * (1 - v / top)) for t, v in pts if math.isfinite(v)]
        if xy:
            out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in xy)}"/>')
        lx, ly = 8 + (i % 3) * 168, H - 38 + (i // 3) * 14
        out.append(f'<rect x="{lx}" y="{ly - 8}" width="10" height="3" fill="{c}"/>')
        out.append(f'<text x="{lx + 14}" y="{ly}" font-size="10">{escape(name[:28])}</text>')
    out.append("</g>")
    return out


def main():
    url, start, end, out_path = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    rate = sys.argv[5] if len(sys.argv) > 5 else "1m"
    dash = json.load(open(os.path.join(ROOT, "ops/grafana/idemgate.json")))
    step = max((end - start) / 120, 1)
    panels = dash["panels"]
    rows = (len(panels) + 1) // 2
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{rows * H + 30}" font-family="sans-serif" font-size="12">',
           f'<rect width="100%" height="100%" fill="#f5f5f5"/>',
           f'<text x="10" y="20" font-size="14">{escape(dash["title"])}: the dashboard\'s queries ({len(panels)} panels), '
           f'a real Prometheus scraping Envoy under tests/it/prometheus.rs\'s load ({end - start:.0f} s)</text>']
    empty = []
    for i, p in enumerate(panels):
        lines = []
        for t in p["targets"]:
            expr = t["expr"].replace("$__rate_interval", rate)
            res = query_range(url, expr, start, end, step)
            if not res:
                empty.append(expr)
            for s in res:
                name = legend(t.get("legendFormat", ""), s["metric"]) or expr[:28]
                lines.append((name, [(float(ts), float(v)) for ts, v in s["values"]]))
        svg += chart((i % 2) * W + 5, (i // 2) * H + 30, p["title"], lines, start, end)
    svg.append("</svg>")
    open(out_path, "w").write("\n".join(svg) + "\n")
    print(f"plot-dashboard: {len(panels)} panels to {out_path}; queries without data: {len(empty)}")
    for e in empty:
        print(f"  no data: {e}")
    sys.exit(1 if empty else 0)


if __name__ == "__main__":
    main()
