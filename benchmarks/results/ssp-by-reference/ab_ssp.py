import sys, statistics
from pathlib import Path
sys.path.insert(0, "/tmp/wtb")
from benchmarks import steps
trees = {"old": Path("/tmp/wtb"), "new": Path("/tmp/wt-ssp")}
def rate(tree, staleness):
    records = steps._tensorbus("1M", 2, "ssp", 3000, "--batch-size", "1", "--lr", "0.01",
                               "--staleness", str(staleness), tree=tree)
    at = [r["train_s"] for r in records if r["event"] == "step"]
    steady = at[len(at) // 4:]
    by_ref = sum(w["by_reference"] for w in records[-1]["per_worker"].values())
    return (len(steady) - 1) / (steady[-1] - steady[0]), by_ref
for staleness in (2, 0):
    ratios = []
    for r in range(4):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        t = {}
        for k in order:
            t[k] = rate(trees[k], staleness)
        ratios.append(t["new"][0] / t["old"][0])
        print(staleness, r, {k: (round(v[0], 1), v[1]) for k, v in t.items()}, round(ratios[-1], 3), flush=True)
    print("staleness", staleness, "median new/old updates/s", round(statistics.median(ratios), 3), round(min(ratios), 3), round(max(ratios), 3), flush=True)
