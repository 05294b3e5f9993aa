#!/usr/bin/env python3
"""llama.cpp's view of a model on a text: token ids (BOS first) and the top-5 logits at a few
positions, an independent reference for the tokenizers and forwards in src/model/.

Needs `pip install llama-cpp-python==0.3.16` (builds llama.cpp from source, ~10 minutes on
2 cores). Usage: python3 scripts/llama-cpp-reference.py MODEL.gguf TEXT N OUT.json
"""
import json
import sys

import numpy as np
from llama_cpp import Llama
import llama_cpp


def main():
    model, text_path, n, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    llm = Llama(model_path=model, n_ctx=max(2048, n), logits_all=True, verbose=False,
                n_threads=2, n_batch=512)
    ids = llm.tokenize(open(text_path, "rb").read(), add_bos=True, special=False)[:n]
    llm.eval(ids)
    scores = np.array(llm.scores[:n])
    positions = sorted({0, 5, 100, n // 2, n - 1} | {p for p in (400, 511, 512, 513, 540) if p < n})
    out = {
        "generator": f"scripts/llama-cpp-reference.py (llama-cpp-python {llama_cpp.__version__})",
        "text": text_path, "ids": ids,
        "positions": {str(p): {"top": np.argsort(-scores[p])[:5].tolist(),
                               "logits": np.sort(scores[p])[::-1][:5].tolist()} for p in positions},
    }
    with open(out_path, "w") as f:
        json.dump(out, f)
        f.write("\n")


if __name__ == "__main__":
    main()
