#!/usr/bin/env python3
"""Replays the engine's online recalibration (specdec/src/recal.rs) on the blocks that
`dspark eval-drafter --blocks FILE` writes, for other settings than the ones the engine ran.

With a fixed gamma and no scheduler, what `eval-drafter` drafts and verifies does not depend on
the served confidences, so a replay on the same blocks is a side-by-side comparison of two
settings on one run. The replay mirrors recal.rs step for step (binned logits, ridge-penalized
Newton refits every 8 verdicts, shrunk per-bin corrections, fading) and first checks itself
against the confidences the engine served (median |replay - served| is printed; blocks of one
engine step are replayed in file order, so a few differ in the refit timing).

Usage: scripts/recal-replay.py BLOCKS.jsonl [--greedy] [--half-life 1000,4000] [--ridge 25]
       [--bin-ridge 100]
Prints, per prompt set and setting, the cumulative ECE (%) per block position and the worst.
"""
import argparse
import json
import math

BINS, LMIN, LMAX, REFIT_EVERY, ECE_BINS = 32, -8.0, 8.0, 8, 15
STRONG_RUN = 0.85


def sig(z):
    return 1.0 / (1.0 + math.exp(-z))


def logit(c):
    c = min(max(c, 1e-6), 1 - 1e-6)
    return min(max(math.log(c / (1 - c)), LMIN), LMAX)


def bin_of(l):
    return min(int((l - LMIN) / (LMAX - LMIN) * BINS), BINS - 1)


class PosFit:
    def __init__(self):
        self.n, self.s, self.l = [0.0] * BINS, [0.0] * BINS, [0.0] * BINS
        self.a, self.b, self.since = 1.0, 0.0, 0

    def observe(self, l, acc, decay, ridge):
        for i in range(BINS):
            self.n[i] *= decay
            self.s[i] *= decay
            self.l[i] *= decay
        b = bin_of(l)
        self.n[b] += 1
        self.s[b] += acc
        self.l[b] += l
        self.since += 1
        if self.since >= REFIT_EVERY:
            self.since = 0
            self.refit(ridge)

    def logit_of(self, l, bin_ridge):
        z = self.a * l + self.b
        b = bin_of(l)
        n = self.n[b]
        if n < 1e-9:
            return z
        p = sig(self.a * self.l[b] / n + self.b)
        return z + (self.s[b] - n * p) / (n * p * (1 - p) + bin_ridge * 0.25)

    def refit(self, ridge):
        lam = ridge * 0.25
        a, c = self.a, self.b
        for _ in range(4):
            ga, gb = lam * (a - 1), lam * c
            haa, hab, hbb = lam, 0.0, lam
            for i in range(BINS):
                n = self.n[i]
                if n < 1e-9:
                    continue
                x = self.l[i] / n
                p = sig(a * x + c)
                r = n * p - self.s[i]
                ga += r * x
                gb += r
                w = n * p * (1 - p)
                haa += w * x * x
                hab += w * x
                hbb += w
            det = haa * hbb - hab * hab
            if det != det or det <= 1e-12:
                return
            da = (hbb * ga - hab * gb) / det
            db = (haa * gb - hab * ga) / det
            a_new = min(max(a - da, 0.05), 5.0)
            if a_new != a - da:
                db = gb / hbb
            a = a_new
            c = min(max(c - db, -6.0), 6.0)
            if abs(da) + abs(db) < 1e-6:
                break
        self.a, self.b = a, c


def kind(greedy, row):
    k = 1 if not row["copy_run"] else (2 if row["conf"][0] >= STRONG_RUN else 0)
    return int(greedy) * 3 + k


def replay(rows, greedy, half_life, ridge, bin_ridge):
    decay = 0.5 ** (1.0 / half_life) if half_life > 0 else 1.0
    fits = [[PosFit() for _ in range(16)] for _ in range(6)]
    steps = {}
    for r in rows:
        steps.setdefault(r["step"], []).append(r)
    out = []
    for st in sorted(steps):
        batch = steps[st]
        served = []
        for r in batch:
            f = fits[kind(greedy, r)]
            served.append([sig(f[k].logit_of(logit(c), bin_ridge)) for k, c in enumerate(r["conf"])])
        for r, sv in zip(batch, served):
            f = fits[kind(greedy, r)]
            for k, c in enumerate(r["conf"]):
                if k > r["accepted"]:
                    break
                f[k].observe(logit(c), 1.0 if r["accepted"] > k else 0.0, decay, ridge)
            out.append((r, sv))
    return out


def ece_at(pairs, k):
    """Cumulative ECE at position k (0-based) as drafter::calibrate::ece computes it."""
    sp, sy, n = [0.0] * ECE_BINS, [0.0] * ECE_BINS, 0
    for r, sv in pairs:
        if len(sv) <= k:
            continue
        p = 1.0
        for j in range(k + 1):
            p *= sv[j]
        b = min(int(p * ECE_BINS), ECE_BINS - 1)
        sp[b] += p
        sy[b] += 1.0 if r["accepted"] > k else 0.0
        n += 1
    return sum(abs(a - b) for a, b in zip(sp, sy)) / n if n else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("blocks")
    ap.add_argument("--greedy", action="store_true", help="the blocks come from a greedy run")
    ap.add_argument("--half-life", default="1000,4000")
    ap.add_argument("--ridge", type=float, default=25.0)
    ap.add_argument("--bin-ridge", type=float, default=100.0)
    a = ap.parse_args()
    sets = {}
    with open(a.blocks) as f:
        for line in f:
            r = json.loads(line)
            sets.setdefault(r["set"], []).append(r)
    for name, rows in sets.items():
        gamma = max(len(r["conf"]) for r in rows)
        engine = [(r, r["served"]) for r in rows]
        e = [100 * ece_at(engine, k) for k in range(gamma)]
        print(f"{name}: {len(rows)} blocks; served by the engine: worst {max(e):.2f} %, "
              + " ".join(f"{x:.2f}" for x in e))
        for hl in (float(x) for x in a.half_life.split(",")):
            out = replay(rows, a.greedy, hl, a.ridge, a.bin_ridge)
            errs = sorted(max([abs(x - y) for x, y in zip(sv, r["served"])] + [0.0]) for r, sv in out)
            e = [100 * ece_at(out, k) for k in range(gamma)]
            print(f"  half-life {hl:g}: worst {max(e):.2f} %, " + " ".join(f"{x:.2f}" for x in e)
                  + f"   (median |replay - served| {errs[len(errs) // 2]:.1e})")


if __name__ == "__main__":
    main()
