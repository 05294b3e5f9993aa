#!/usr/bin/env python3
"""Keys before RoPE (issue: quality per bit, item 3): does quantizing keys before the rotary
embedding help attention on a real capture?

For every layer of a capture made with `xquant capture --queries` (keys after RoPE, as the
cache holds them), the keys are quantized four ways, each once as they are (after RoPE) and
once before RoPE (the rotation undone at each token's position, quantized, then redone):
uniform min/max codes per channel over groups of 32 tokens (KIVI's keys) at 2 and 3 bits, and
Lloyd-Max levels on Hadamard-rotated head vectors with one f16 norm (`levels: lloyd-max`) at
2 and 3 bits. The sinks (4) and the window (128) stay exact, as in the cache; values stay exact
so only the keys' effect is measured. The last 64 queries attend causally; the score is each
layer's relative squared error of the attention output (as `xquant plan --score` reports
`attention_error`), per layer and summed.

usage: scripts/pre-rope-keys.py CAPTURE.safetensors [ROPE_THETA]   (SmolLM2: 100000)
"""
import json, os, struct, sys
import numpy as np

def load(path):
    f = open(path, 'rb'); n = struct.unpack('<Q', f.read(8))[0]; h = json.loads(f.read(n)); base = 8 + n
    data = open(path, 'rb').read()
    out = {}
    for k, v in h.items():
        if k == '__metadata__': continue
        a, b = v['data_offsets']; dt = {'F16': np.float16, 'F32': np.float32}[v['dtype']]
        out[k] = np.frombuffer(data[base + a: base + b], dtype=dt).reshape(v['shape']).astype(np.float64)
    return out

THETA = float(sys.argv[2]) if len(sys.argv) > 2 else 100000.0
SINKS, WINDOW, G, NQ = 4, 128, 32, 64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tabs = json.load(open(os.path.join(ROOT, 'data', 'codebooks', 'lloyd-max.json')))['tables']

def rope(x, pos, sign=1.0):
    # x [T, D]: adjacent pairs rotated by pos * theta^(-2i/D) (wgsl/llama.wgsl's rope)
    i = np.arange(D // 2); ang = sign * pos[:, None] * THETA ** (-2.0 * i / D)
    c, s = np.cos(ang), np.sin(ang); a, b = x[:, 0::2], x[:, 1::2]
    y = np.empty_like(x); y[:, 0::2] = a * c - b * s; y[:, 1::2] = a * s + b * c
    return y

def uniform_tokens(x, bits):  # groups of G tokens per channel, min/max asymmetric
    y = x.copy(); T = x.shape[0]; L = 2 ** bits - 1
    for a in range(0, T - T % G, G):
        g = x[a:a + G]; lo, hi = g.min(0), g.max(0); sc = np.maximum((hi - lo) / L, 1e-12)
        y[a:a + G] = lo + np.clip(np.round((g - lo) / sc), 0, L) * sc
    return y

def hadamard(n):
    H = np.array([[1.0]])
    while H.shape[0] < n: H = np.block([[H, H], [H, -H]])
    return H / np.sqrt(n)

def lloyd_tokens(x, bits):  # rotated per-token groups of D, norm x levels
    lv = next(t for t in tabs if t['bits'] == bits and t['n'] == D)['levels']; lv = np.array(lv)
    r = x @ HD.T; nrm = np.linalg.norm(r, axis=1, keepdims=True); u = r / np.maximum(nrm, 1e-12)
    mids = (lv[1:] + lv[:-1]) / 2; code = np.searchsorted(mids, u)
    nrm16 = nrm.astype(np.float16).astype(np.float64)
    return (nrm16 * lv[code]) @ HD

def quantize_keys(K, scheme, bits, pre):
    T = K.shape[0]; q = (T - SINKS - WINDOW) // G * G
    pos = np.arange(T, dtype=np.float64)
    X = rope(K, pos, -1.0) if pre else K.copy()
    mid = X[SINKS:SINKS + q]
    X[SINKS:SINKS + q] = uniform_tokens(mid, bits) if scheme == 'uniform' else lloyd_tokens(mid, bits)
    return rope(X, pos, 1.0) if pre else X

def attn(q, K, V, p):
    s = (K[:p + 1] @ q) / np.sqrt(D); w = np.exp(s - s.max()); w /= w.sum(); return w @ V[:p + 1]

def layer_error(Q, K, V, Kh):
    # Q [heads, T, D]; K/V [kv, T, D]
    H, T = Q.shape[0], Q.shape[1]; rep = H // K.shape[0]; num = den = 0.0
    for h in range(H):
        k = h // rep
        for p in range(T - NQ, T):
            o = attn(Q[h, p], K[k], V[k], p); oh = attn(Q[h, p], Kh[k], V[k], p)
            num += ((o - oh) ** 2).sum(); den += (o ** 2).sum()
    return num / den

cap = load(sys.argv[1]); D = cap['past_key_values.0.key'].shape[-1]
rng = np.random.default_rng(7); SIGNS = rng.choice([-1.0, 1.0], D); HD = hadamard(D) * SIGNS[None, :]
layers = len([k for k in cap if k.endswith('.key')])
schemes = [('uniform', 2), ('uniform', 3), ('lloyd', 2), ('lloyd', 3)]
print('layer', *[f'{s}{b}{"-pre" if p else ""}' for s, b in schemes for p in (False, True)])
tot = np.zeros(8)
for l in range(layers):
    K = cap[f'past_key_values.{l}.key'][0]; V = cap[f'past_key_values.{l}.value'][0]; Q = cap[f'q.{l}'][0]
    errs = []
    for s, b in schemes:
        for pre in (False, True):
            Kh = np.stack([quantize_keys(K[k], s, b, pre) for k in range(K.shape[0])])
            errs.append(layer_error(Q, K, V, Kh))
    tot += np.array(errs)
    print(l, *[f'{e:.5f}' for e in errs], flush=True)
print('sum', *[f'{e:.4f}' for e in tot])
