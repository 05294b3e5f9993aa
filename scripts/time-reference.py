#!/usr/bin/env python3
# Times the reference XQuant primitives (veloxquant-mlx 0.94.15, MLX CPU backend) that
# the project compares against. Sets up its own venv under ~/.cache/xquant-wgpu on first run.
# Usage: scripts/time-reference.py [--dims 1,8,4096,128] [--bits 2] [--group 32]
#                                  [--residual-bits 4] [--iters 20] [--repeats 3] [--json]
import argparse, importlib.util, json, os, platform, statistics, subprocess, sys, time, zipfile
from pathlib import Path

MLX_VERSION = "0.32.4"
VQ_VERSION = "0.94.15"
CACHE = Path.home() / ".cache" / "xquant-wgpu"
VENV = CACHE / "mlx-venv"
VENV_PY = VENV / "bin" / "python"
WHEEL_DIR = CACHE / "veloxquant"
XQUANT = WHEEL_DIR / "xquant.py"


def mlx_ok():
    try:
        import mlx.core as mx
        return mx.__version__ == MLX_VERSION
    except ImportError:
        return False


def setup():
    """Create the venv, install pinned MLX, fetch the wheel and extract xquant.py (once each)."""
    if not VENV_PY.exists():
        subprocess.check_call([sys.executable, "-m", "venv", str(VENV)])
    if subprocess.call([str(VENV_PY), "-c", f"import mlx.core as m; assert m.__version__ == '{MLX_VERSION}'"],
                       stderr=subprocess.DEVNULL) != 0:
        subprocess.check_call([str(VENV_PY), "-m", "pip", "install", "-q", f"mlx[cpu]=={MLX_VERSION}", "numpy"])
    if not XQUANT.exists():
        wheel = WHEEL_DIR / f"veloxquant_mlx-{VQ_VERSION}-py3-none-any.whl"
        if not wheel.exists():
            subprocess.check_call([str(VENV_PY), "-m", "pip", "download", "-q", "--no-deps",
                                   f"veloxquant-mlx=={VQ_VERSION}", "-d", str(WHEEL_DIR)])
        with zipfile.ZipFile(wheel) as z:
            XQUANT.write_bytes(z.read("veloxquant_mlx/quantizers/xquant.py"))


if not mlx_ok() or not XQUANT.exists():
    setup()
    if not mlx_ok():  # re-run this script with the venv's python
        if Path(sys.prefix).resolve() == VENV.resolve():
            sys.exit(f"mlx=={MLX_VERSION} does not import inside {VENV}")
        os.execv(str(VENV_PY), [str(VENV_PY), os.path.abspath(__file__), *sys.argv[1:]])

import mlx.core as mx
import numpy as np

# xquant.py imports only mlx.core; load it standalone (the package pulls in much more).
spec = importlib.util.spec_from_file_location("xquant", XQUANT)
xq = importlib.util.module_from_spec(spec)
spec.loader.exec_module(xq)
mx.set_default_device(mx.cpu)

ap = argparse.ArgumentParser(description="Time the MLX reference XQuant primitives on the CPU.")
ap.add_argument("--dims", default="1,8,4096,128", help="B,H,S,D")
ap.add_argument("--bits", type=int, default=2)
ap.add_argument("--group", type=int, default=32, help="tokens per group (along S)")
ap.add_argument("--residual-bits", type=int, default=4)
ap.add_argument("--iters", type=int, default=20)
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--json", action="store_true")
a = ap.parse_args()
dims = tuple(int(v) for v in a.dims.split(","))
assert len(dims) == 4, "--dims takes B,H,S,D"

rng = np.random.default_rng(0)
x = mx.array(rng.standard_normal(dims).astype(np.float16))        # anchor layer
x_reuse = mx.array(rng.standard_normal(dims).astype(np.float16))  # reuse layer
mx.eval(x, x_reuse)

# Functions called (veloxquant_mlx/quantizers/xquant.py):
#   quantize_codes_batched(x, bits, group_size) -> (codes [B,H,G,gs,D] f32, GroupParams(scale, zero, n_rows, bits))
#   dequant_with_params_batched(codes, params, out_dtype=mx.float16) -> [B,H,S,D] f16
#   compute_reuse_params_batched(x, codes, bits, group_size) -> GroupParams
#   quantize_residual_batched(x, recon, bits, group_size, out_dtype=mx.float16) -> [B,H,S,D] f16
codes, params = xq.quantize_codes_batched(x, a.bits, a.group)
mx.eval(codes, params.scale, params.zero)


def quantize():
    c, p = xq.quantize_codes_batched(x, a.bits, a.group)
    mx.eval(c, p.scale, p.zero)


def dequantize():
    mx.eval(xq.dequant_with_params_batched(codes, params))


def quant_dequant():
    c, p = xq.quantize_codes_batched(x, a.bits, a.group)
    mx.eval(c, p.scale, p.zero, xq.dequant_with_params_batched(c, p))


def reuse():
    # Reuse layer: fit its own scale/zero to the anchor's codes, reconstruct, then
    # quantize the residual (x_reuse - recon) at --residual-bits.
    p = xq.compute_reuse_params_batched(x_reuse, codes, a.bits, a.group)
    recon = xq.dequant_with_params_batched(codes, p)
    mx.eval(p.scale, p.zero, xq.quantize_residual_batched(x_reuse, recon, a.residual_bits, a.group))


def bench(fn):
    fn()  # warm-up
    rounds = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        for _ in range(a.iters):
            fn()
        rounds.append((time.perf_counter() - t) * 1e3 / a.iters)
    return {"best_ms": round(min(rounds), 3), "median_ms": round(statistics.median(rounds), 3)}


cases = {
    "quantize": quantize,
    "dequantize": dequantize,
    "quantize+dequantize": quant_dequant,
    "reuse": reuse,
}
results = {name: bench(fn) for name, fn in cases.items()}


def cpu_model():
    # platform.processor() is often empty on Linux; fall back to /proc/cpuinfo.
    if platform.processor():
        return platform.processor()
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


if a.json:
    print(json.dumps({
        "mlx": mx.__version__, "veloxquant_mlx": VQ_VERSION, "device": str(mx.default_device()),
        "dims": dims, "dtype": "float16", "bits": a.bits, "group": a.group,
        "residual_bits": a.residual_bits, "iters": a.iters, "repeats": a.repeats,
        "processor": cpu_model(), "cpu_count": os.cpu_count(), "results": results,
    }, indent=2))
else:
    print(f"MLX {mx.__version__} ({mx.default_device()}), dims {dims} float16, {a.bits}-bit, "
          f"group {a.group}, {a.iters} iters x {a.repeats} rounds, {cpu_model()} x{os.cpu_count()}\n")
    print("| op | best ms | median ms |\n|---|---:|---:|")
    for name, r in results.items():
        label = f"reuse (fit params + dequant + {a.residual_bits}-bit residual)" if name == "reuse" else name
        print(f"| {label} | {r['best_ms']:.2f} | {r['median_ms']:.2f} |")
