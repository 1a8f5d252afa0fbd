"""PS / ring step-time ratios, default device against explicit, from the default_vs_explicit sweep's summaries."""
import json, sys
from pathlib import Path
rows = {}
for f in sorted(Path(sys.argv[1]).glob("*/summary.json")):
    s = json.loads(f.read_text())
    if s.get("status") != "finished":
        continue
    c = json.loads((f.parent / "config.json").read_text())
    b, cl = c["backend"], c["cluster"]
    key = (b["kind"], b["world_size"], "explicit" if "device_tflops" in f.parent.name else "default")
    vd = s.get("virtual_device", {})
    rows[key] = (s["step_time_s"], vd.get("dilation"), s["cluster"].get("wall_s"), vd.get("flops_per_s") or vd.get("tflops"))
print("| N | device | ring step (D) | PS N servers step (D) | PS / ring |")
print("|---:|---|---:|---:|---:|")
ratios = {}
for n in (2, 4, 8):
    for dev in ("default", "explicit"):
        r, p = rows.get(("ddp", n, dev)), rows.get(("ps", n, dev))
        if r and p:
            ratios[n, dev] = p[0] / r[0]
            print(f"| {n} | {dev} | {r[0]*1e3:.1f} ms ({r[1]:g}) | {p[0]*1e3:.1f} ms ({p[1]:g}) | {p[0]/r[0]:.3f} |")
for n in (2, 4, 8):
    if (n, "default") in ratios and (n, "explicit") in ratios:
        print(f"N = {n}: default / explicit ratio {ratios[n,'default']/ratios[n,'explicit']:.3f}")
