#!/usr/bin/env python3
"""Writes tests/data/ggml-blocks.json: random blocks of every GGML type the runtime reads,
dequantized by an independent implementation (gguf-py, `pip install gguf==0.19.0`), for
`tests/gguf_blocks.rs` to compare against `xquant_wgpu::model::gguf::dequantize`.

Blocks are random bytes except their f16 scales (d, m, dmin), drawn from ±[1e-3, 0.1] so that
no block holds an infinity or NaN. With the model fetched (scripts/fetch-model gemma3-270m), two
rows of one tensor of every type in the file are added too.
"""
import json
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES, GGUFReader, quants

# Byte offsets of each type's f16 scale fields within a block.
SCALES = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


def random_blocks(rng, ty, n):
    _, size = GGML_QUANT_SIZES[ty]
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in SCALES[ty]:
        mag = rng.uniform(1e-3, 0.1, size=n) * rng.choice([-1.0, 1.0], size=n)
        b[:, off:off + 2] = mag.astype(np.float16).view(np.uint8).reshape(n, 2)
    return b


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "tests/data/ggml-blocks.json"
    rng = np.random.default_rng(22)
    cases = []
    for ty in SCALES:
        blocks = random_blocks(rng, ty, 3)
        values = quants.dequantize(blocks.reshape(-1), ty).astype(np.float32)
        cases.append({"type": ty.name, "hex": blocks.tobytes().hex(),
                      "values": [float(v) for v in values]})
    rows = []
    model = os.path.expanduser(os.environ.get(
        "XQ_GEMMA", "~/.cache/xquant-wgpu/gemma-3-270m-q4_k_m.gguf"))
    if os.path.exists(model):
        reader = GGUFReader(model)
        seen = set()
        for t in reader.tensors:
            if t.tensor_type in seen or t.tensor_type not in SCALES or len(t.shape) != 2:
                continue
            seen.add(t.tensor_type)
            full = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            for row in (0, int(t.shape[1]) - 1):
                rows.append({"tensor": t.name, "type": t.tensor_type.name, "row": row,
                             "values": [float(v) for v in full[row]]})
    with open(out_path, "w") as f:
        json.dump({"generator": "scripts/ggml-blocks.py (gguf-py quants.dequantize)",
                   "blocks": cases, "model_rows": rows}, f)
        f.write("\n")
    print(f"{out_path}: {len(cases)} block cases, {len(rows)} model rows")


if __name__ == "__main__":
    main()
