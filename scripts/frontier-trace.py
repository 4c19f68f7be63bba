#!/usr/bin/env python3
"""Summarizes the timed (interleaved) phase of a `dspark bench frontier` step trace, per arm.

Trace: one round at one concurrency, with
  DSPARK_LOG=dspark_scheduler=debug,specdec=trace NO_COLOR=1 dspark bench frontier ... 2> trace.log
Arms are told apart by the `step done` fields: proposer "none" (no speculation), policy=true
(the scheduler), else a fixed γ. The timed phase is what follows the settle pause: the last gap
between log lines of over 0.4 s that the next step's own duration does not explain.
Usage: scripts/frontier-trace.py trace.log[.gz]
"""
import collections, datetime, gzip, re, statistics, sys

KV = re.compile(r'(\w+)=("[^"]*"|\S+)')
PARTS = ("forward", "draft", "accept", "features", "plan")


def lines(path):
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt", errors="replace") as f:
        yield from f


def main(path):
    phase, prev = 0, None
    steps = collections.defaultdict(list)  # arm -> [step]
    pending = {}
    for line in lines(path):
        if not line[:4].isdigit():
            continue
        t = datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()
        d = {k: v.strip('"') for k, v in KV.findall(line)}
        own = float(d.get("total_s", 0.0))
        if prev is not None and t - prev - own > 0.4:
            phase += 1
        prev = t
        if "step done" in line:
            arm = "none" if d["proposer"] == "none" else ("scheduler" if d["policy"] == "true" else "fixed")
            s = dict(phase=phase, total=own, B=int(d["batch_tokens"]), features=d["features"] == "true",
                     parts={k: float(d.get(k + "_s", 0.0)) for k in PARTS})
            s.update(pending.pop(arm, {}))
            steps[arm].append(s)
        elif "free drafts" in line:
            pending.setdefault("scheduler", {}).update(free=int(d["k_total"]), b0=int(d["batch_tokens"]))
        elif "verified drafts" in line and d.get("free") == "true":
            pending.setdefault("scheduler", {}).update(accepted=int(d["accepted"]), expected=float(d["expected"]))
    last = max(s["phase"] for st in steps.values() for s in st)
    timed = {arm: [s for s in st if s["phase"] == last] for arm, st in steps.items()}
    for arm, st in sorted(timed.items()):
        sizes = collections.Counter(s["B"] for s in st)
        print(f"{arm:9} steps {len(st):5}  seconds {sum(s['total'] for s in st):8.3f}  "
              f"feature steps {sum(s['features'] for s in st):4}  sizes {sorted(sizes.items())}")
    # Where `none` and the scheduler differ: each arm's seconds per part of a step (what is
    # left of a step's total is "other"), then per step size each arm's steps, median ms and
    # seconds in all.
    a, b = timed.get("none", []), timed.get("scheduler", [])
    if a and b:
        print("per size (none | scheduler): steps, median ms, seconds; parts (s) over all steps")
        for arm, st in (("none", a), ("scheduler", b)):
            tot = {k: sum(s["parts"][k] for s in st) for k in PARTS}
            rest = sum(s["total"] for s in st) - sum(tot.values())
            print(f"  {arm:9} " + "  ".join(f"{k} {v:.3f}" for k, v in tot.items()) + f"  other {rest:.3f}")
        ga, gb = collections.defaultdict(list), collections.defaultdict(list)
        for s in a:
            ga[s["B"]].append(s["total"] * 1e3)
        for s in b:
            gb[s["B"]].append(s["total"] * 1e3)
        for size in sorted(set(ga) | set(gb)):
            x, y = ga.get(size, []), gb.get(size, [])
            fmt = lambda v: f"{len(v):4} {statistics.median(v) if v else 0:7.1f} {sum(v) / 1e3:6.3f}"
            print(f"  B {size:4}: {fmt(x)} | {fmt(y)}")
    sched = timed.get("scheduler", [])
    free = [s for s in sched if s.get("free", 0) > 0]
    print(f"free-draft steps {len(free)}: drafts {sum(s['free'] for s in free)}, accepted "
          f"{sum(s.get('accepted', 0) for s in free)}, expected {sum(s.get('expected', 0) for s in free):.1f}")
    by_b = collections.defaultdict(list)
    for s in sched:
        by_b[(s["B"], s.get("free", 0) > 0)].append(s["total"] * 1e3)
    for (b, f), v in sorted(by_b.items()):
        if len(v) >= 3:
            print(f"  scheduler steps of {b:4} tokens{' (free drafts)' if f else '              '}: "
                  f"{len(v):4}, median {statistics.median(v):7.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1])
