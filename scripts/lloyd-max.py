#!/usr/bin/env python3
# Lloyd-Max codebooks for rotated head vectors: an implementation independent of
# src/reference/codebook.rs (numpy only), whose output tests/codebook.rs checks the Rust against.
#
# After a random rotation, one coordinate of a group of n values divided by the group's L2 norm
# is distributed like one coordinate of a uniform random unit vector in R^n: density
# f(x) ~ (1 - x^2)^((n-3)/2) on [-1, 1]. With x = cos(t) the density of t is ~ sin(t)^(n-2) on
# [0, pi], smooth for every n >= 2. For b bits and each n this finds the 2^b Lloyd-Max levels
# (symmetric about 0): starting from equal-width cells over [0, min(1, 3/sqrt(n))], it alternates
# boundaries = midpoints of the levels and levels = conditional means of the cells until no level
# moves by 1e-12 (at most 10,000 rounds). Each cell's mass and first moment are integrated in t by
# composite Gauss-Legendre quadrature (the Rust twin uses a cumulative table and a closed-form
# moment).
#
# Usage: scripts/lloyd-max.py [--out data/codebooks/lloyd-max.json]
import argparse, json
from pathlib import Path

import numpy as np

BITS = [1, 2, 3, 4]
DIMS = [2, 4, 8, 16, 32, 48, 64, 96, 128, 256]
TOL = 1e-12
MAX_ITERS = 10_000
PANELS, NODES = 16, 24  # Gauss-Legendre panels per cell and nodes per panel

GL_X, GL_W = np.polynomial.legendre.leggauss(NODES)


def cell_moments(lo, hi, n):
    """Mass and first moment of f over each cell [lo[i], hi[i]] (0 <= lo < hi <= 1), in t."""
    t_lo, t_hi = np.arccos(hi), np.arccos(lo)  # x = cos t is decreasing
    edges = t_lo[:, None] + (t_hi - t_lo)[:, None] * np.linspace(0.0, 1.0, PANELS + 1)[None, :]
    a, b = edges[:, :-1], edges[:, 1:]
    half = 0.5 * (b - a)
    t = (0.5 * (a + b))[..., None] + half[..., None] * GL_X  # cells x panels x nodes
    w = half[..., None] * GL_W
    dens = np.sin(t) ** (n - 2)
    return (w * dens).sum(axis=(1, 2)), (w * dens * np.cos(t)).sum(axis=(1, 2))


def lloyd_max(bits, n):
    """The 2^bits ascending levels; the positive half is iterated, the negative one mirrors it."""
    k = 1 << (bits - 1)  # levels in (0, 1]; a boundary sits at 0
    levels = (np.arange(k) + 0.5) / k * min(1.0, 3.0 / np.sqrt(n))  # equal widths where the mass is
    for it in range(1, MAX_ITERS + 1):
        bounds = np.concatenate(([0.0], 0.5 * (levels[:-1] + levels[1:]), [1.0]))
        mass, moment = cell_moments(bounds[:-1], bounds[1:], n)
        new = np.where(mass > 0, moment / np.where(mass > 0, mass, 1.0), levels)
        delta = np.max(np.abs(new - levels))
        levels = new
        if delta < TOL:
            break
    return np.concatenate((-levels[::-1], levels)), it


def main():
    ap = argparse.ArgumentParser(description="Lloyd-Max codebooks for rotated head vectors.")
    root = Path(__file__).resolve().parent.parent
    ap.add_argument("--out", type=Path, default=root / "data" / "codebooks" / "lloyd-max.json")
    args = ap.parse_args()
    tables = []
    for bits in BITS:
        for n in DIMS:
            levels, iters = lloyd_max(bits, n)
            print(f"bits {bits} n {n:4d}: {iters:5d} rounds, top level {levels[-1]:.9g}")
            tables.append({"bits": bits, "n": n, "levels": [float(f"{c:.9g}") for c in levels]})
    doc = {
        "density": "f(x) ~ (1 - x^2)^((n-3)/2) on [-1, 1]: one coordinate of a uniform random "
                   "unit vector in R^n (a rotated group of n values over its L2 norm)",
        "method": "Lloyd-Max (boundaries = midpoints, levels = conditional means) until no level "
                  "moves by 1e-12; scripts/lloyd-max.py",
        "tables": tables,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join("    " + json.dumps(t) for t in tables)
    head = json.dumps({k: v for k, v in doc.items() if k != "tables"}, indent=2)[:-2]
    args.out.write_text(head + ',\n  "tables": [\n' + lines + "\n  ]\n}\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
