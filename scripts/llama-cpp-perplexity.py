#!/usr/bin/env python3
"""llama.cpp's perplexity of a model on the first N tokens of a text (BOS first, as `xquant
eval` counts them: every token after the first predicted from the ones before it, in one
pass with f16 K/V), an independent reference for `xquant eval`'s f16 row.

Needs `pip install llama-cpp-python==0.3.16` (builds llama.cpp from source, ~10 minutes on
2 cores). Usage: python3 scripts/llama-cpp-perplexity.py MODEL.gguf TEXT N [OUT.json]
"""
import json
import sys

import numpy as np
import llama_cpp
from llama_cpp import Llama


def main():
    model, text_path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = Llama(model_path=model, n_ctx=max(2048, n), logits_all=True, verbose=False,
                n_threads=2, n_batch=512)
    ids = llm.tokenize(open(text_path, "rb").read(), add_bos=True, special=False)[:n]
    llm.eval(ids)
    scores = np.array(llm.scores[: len(ids)], dtype=np.float64)
    top = scores.max(axis=1, keepdims=True)
    logp = scores - top - np.log(np.exp(scores - top).sum(axis=1, keepdims=True))
    nll = -np.mean([logp[i, ids[i + 1]] for i in range(len(ids) - 1)])
    out = {
        "generator": f"scripts/llama-cpp-perplexity.py (llama-cpp-python {llama_cpp.__version__})",
        "model": model.rsplit("/", 1)[-1], "text": text_path, "tokens": len(ids),
        "perplexity": float(np.exp(nll)),
        "greedy": [int(np.argmax(scores[i])) for i in range(len(ids))],
    }
    text = json.dumps(out)
    if len(sys.argv) > 4:
        with open(sys.argv[4], "w") as f:
            f.write(text + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "greedy"}))


if __name__ == "__main__":
    main()
