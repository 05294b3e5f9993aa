// The forward pass of the llama and gemma3 families: embedding (scaled), RMSNorm (of
// tokens, or of heads for Q/K norms; replacing or adding to its output), matmul on quantized
// weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K or f32, read block by block), RoPE
// (adjacent pairs or halves), the gated FFN's activation (SiLU or GELU). Attention is
// wgsl/attention.wgsl's (over the cache, or a prefill's own K/V).
// Activations are f32, row-major [T, features] unless noted.

struct Dims {
    t: u32,          // tokens in this pass
    k: u32,          // input features (matmul, rmsnorm width)
    n: u32,          // output features (matmul rows)
    heads: u32,      // heads of the tensor being roped
    n0: u32,         // matmul: first output column (a part of a split weight); embed: first row
    head_dim: u32,   // D
    pos0: u32,       // absolute position of token 0
    grid_x: u32,     // workgroups along x
    eps: f32,        // RMSNorm epsilon
    theta: f32,      // RoPE base
    scale: f32,      // embed: the embedding scale
    x_row0: u32,     // matmul/rmsnorm: first input row used (logits of the last token only)
    y_cols: u32,     // matmul: columns of y (n0 + n <= y_cols)
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override WEIGHT: u32 = 0u;        // matmul weights: 0 Q4_1 blocks, 1 Q8_0 (9 words per block), both in row quads
                                  // (`quad_block`), 2 f32,
                                  // 3 Q5_1 blocks (6 words), K-quant super-blocks of 256 weights as
                                  // stored: 4 Q4_K (36 words), 5 Q5_K (44), 6 Q6_K (53: 210 bytes, 2 of padding);
                                  // 7 Q5_0 (6 words: 2 bytes of padding after d), 8 Q4_0 (5 words: the same)
override ACCUMULATE: bool = false; // matmul, rmsnorm: add into y (residual connections)
override ROTATE: bool = true;     // rope: rotate (Q, K) or only move to [heads, T, D] (V)
override HALVES: bool = false;    // rope: pairs (x[i], x[i + D/2]) (NEOX) instead of (x[2i], x[2i+1])
override GELU: bool = false;      // gated: GELU (tanh) instead of SiLU
override WG: u32 = 64u;

override TILE_K: u32 = 2048u;     // matmul: weights of a row held in workgroup memory (at a time)

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> x: array<f32>;          // [T, K] input
@group(0) @binding(2) var<storage, read> w: array<u32>;          // [N, K] weights, blocks of 32 along K
@group(0) @binding(3) var<storage, read_write> y: array<f32>;    // [T, N] output
@group(0) @binding(4) var<storage, read> norm_w: array<f32>;     // [K] RMSNorm gain
@group(0) @binding(5) var<storage, read> tokens: array<u32>;     // [T] token ids
@group(0) @binding(6) var<storage, read> x4: array<vec4<f32>>;   // x again, 4 features a load (matmul_few)
@group(0) @binding(7) var<storage, read> w4: array<vec4<u32>>;   // w again, 16 bytes a load (row quads)

var<workgroup> row: array<f32, TILE_K>;
var<workgroup> partial: array<f32, WG>;

// Where a matmul stores output (t, n) of its part of the weight rows.
fn y_at(t: u32, n: u32) -> u32 {
    return t * dims.y_cols + dims.n0 + n;
}

fn flat_id(wg: vec3<u32>, lid: u32) -> u32 {
    return (wg.y * dims.grid_x + wg.x) * WG + lid;
}

// Q4_1 and Q8_0 weights come as row quads: rows 4r .. 4r + 3 (the last quad padded with
// zero rows), each quad's blocks in order, a block of the quad `quad_vecs()` vec4s: the 4
// rows' scale words (Q4_1: [d, m] f16 pairs; Q8_0: d), then code word j of the 4 rows for
// each j (Q4_1: bytes 4j .. 4j + 3 of ggml's 16 nibble bytes; Q8_0: int8 4j .. 4j + 3). So a
// kernel walking 4 rows loads one vec4 where it loaded a word of each row.
fn quad_vecs() -> u32 {
    return select(9u, 5u, WEIGHT == 0u);
}

// Whether the weights come as row quads.
fn row_quads() -> bool {
    return WEIGHT <= 1u;
}

// The vec4 index of block `blk` of the row quad holding row `n`.
fn quad_block(n: u32, blk: u32) -> u32 {
    return quad_vecs() * ((n / 4u) * (dims.k / 32u) + blk);
}

// The word index of row `n`'s scale word in block `blk` of its row quad; the row's code
// word j is 4 (j + 1) words on.
fn quad_row_word(n: u32, blk: u32) -> u32 {
    return 4u * quad_block(n, blk) + n % 4u;
}

// Element `e` of weight row `n` (K elements, blocks of 32).
fn weight(n: u32, e: u32) -> f32 {
    let b = (n * dims.k + e) / 32u;
    let i = e % 32u;
    if WEIGHT == 0u {
        // Q4_1: [d, m] f16 pair, then 16 bytes: element i < 16 in low nibbles, i >= 16 in high.
        let at = quad_row_word(n, e / 32u);
        let dm = unpack2x16float(w[at]);
        let j = i % 16u;
        let byte = (w[at + 4u + 4u * (j / 4u)] >> (8u * (j % 4u))) & 0xffu;
        let q = select(byte & 15u, byte >> 4u, i >= 16u);
        return dm.x * f32(q) + dm.y;
    } else if WEIGHT == 1u {
        // Q8_0: the row's f16 scale word, then its 32 int8, 4 a word.
        let at = quad_row_word(n, e / 32u);
        let d = unpack2x16float(w[at]).x;
        let word = w[at + 4u + 4u * (i / 4u)];
        let q = bitcast<i32>(word << (24u - 8u * (i % 4u))) >> 24u;
        return d * f32(q);
    } else if WEIGHT >= 3u {
        let so = block_scale(b);
        return so.x * codes4(b, i / 4u)[i % 4u] + so.y;
    }
    return bitcast<f32>(w[n * dims.k + e]);
}

// Whether blocks have an offset (a min) besides their scale: the inputs' sums are needed.
fn has_offset() -> bool {
    return WEIGHT == 0u || WEIGHT == 3u || WEIGHT == 4u || WEIGHT == 5u;
}

// Words of a K-quant super-block of 256 weights (8 blocks of 32).
fn super_words() -> u32 {
    return select(select(36u, 44u, WEIGHT == 5u), 53u, WEIGHT == 6u);
}

// Byte `i` of the weights from word `at`.
fn byte_at(at: u32, i: u32) -> u32 {
    return (w[at + i / 4u] >> (8u * (i % 4u))) & 0xffu;
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block `sub` (ggml's 12 packed bytes, from
// word 1 of the super-block at word `base`).
fn k_scale_min(base: u32, sub: u32) -> vec2<f32> {
    let s = base + 1u;
    if sub < 4u {
        return vec2<f32>(f32(byte_at(s, sub) & 63u), f32(byte_at(s, sub + 4u) & 63u));
    }
    let hi = byte_at(s, sub + 4u);
    let sc = (hi & 15u) | ((byte_at(s, sub - 4u) >> 6u) << 4u);
    let mn = (hi >> 4u) | ((byte_at(s, sub) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(mn));
}

// Block b's scale and offset (Q5_1 and the K-quants; Q4_1, Q8_0 and f32 in `scales4`):
// each exactly the product the CPU's `gguf::affine_blocks` forms (an f16 times a small
// integer).
fn block_scale(b: u32) -> vec2<f32> {
    if WEIGHT == 3u {
        return unpack2x16float(w[6u * b]);
    } else if WEIGHT == 7u {
        return vec2<f32>(unpack2x16float(w[6u * b]).x, 0.0);
    } else if WEIGHT == 8u {
        return vec2<f32>(unpack2x16float(w[5u * b]).x, 0.0);
    } else if WEIGHT == 6u {
        return vec2<f32>(unpack2x16float(w[53u * (b / 8u) + 52u]).x, 0.0);
    }
    let base = super_words() * (b / 8u);
    let dm = unpack2x16float(w[base]);
    let sm = k_scale_min(base, b % 8u);
    return vec2<f32>(dm.x * sm.x, -(dm.y * sm.y));
}

// Codes 4j .. 4j + 3 of block b before its scale, as floats (Q5_1, Q5_0 and Q4_0 (signed),
// the K-quants; Q6_K's times its sub-block's int8 scale, which is exact). The layouts are
// ggml's.
fn codes4(b: u32, j: u32) -> vec4<f32> {
    let lane = vec4<u32>(0u, 8u, 16u, 24u);
    if WEIGHT == 3u || WEIGHT == 7u {
        // Q5_1 and Q5_0: word 0 d (and m), word 1 the fifth bits, words 2..5 codes 0..15 in
        // low nibbles and 16..31 in high ones; Q5_0's codes are centred on 16.
        let low = (vec4<u32>(w[6u * b + 2u + j % 4u]) >> (lane + vec4<u32>(4u * (j / 4u)))) & vec4<u32>(15u);
        let fifth = (vec4<u32>(w[6u * b + 1u]) >> (vec4<u32>(4u * j) + vec4<u32>(0u, 1u, 2u, 3u))) & vec4<u32>(1u);
        let q = vec4<f32>(low | (fifth << vec4<u32>(4u)));
        return select(q, q - vec4<f32>(16.0), WEIGHT == 7u);
    } else if WEIGHT == 8u {
        // Q4_0: word 0 d, words 1..4 codes 0..15 in low nibbles and 16..31 in high ones,
        // centred on 8.
        let q = (vec4<u32>(w[5u * b + 1u + j % 4u]) >> (lane + vec4<u32>(4u * (j / 4u)))) & vec4<u32>(15u);
        return vec4<f32>(q) - vec4<f32>(8.0);
    }
    let sub = b % 8u;
    if WEIGHT == 4u || WEIGHT == 5u {
        // Words 4.. (Q4_K) or 12.. (Q5_K): 4 runs of 32 bytes, low nibbles sub-block 2c, high
        // ones 2c + 1; Q5_K's fifth bits: bit `sub` of bytes 16..47 (words 4..11).
        let base = super_words() * (b / 8u);
        let qs = base + select(4u, 12u, WEIGHT == 5u) + 8u * (sub / 2u) + j;
        var q = (vec4<u32>(w[qs]) >> (lane + vec4<u32>(4u * (sub % 2u)))) & vec4<u32>(15u);
        if WEIGHT == 5u {
            q |= ((vec4<u32>(w[base + 4u + j]) >> (lane + vec4<u32>(sub))) & vec4<u32>(1u)) << vec4<u32>(4u);
        }
        return vec4<f32>(q);
    }
    // Q6_K: ql in words 0..31, qh 32..47, 16 int8 scales 48..51, d 52; two runs of 128
    // weights (n), each of four blocks (k) with a scale per 16 weights.
    let base = 53u * (b / 8u);
    let n = sub / 4u;
    let k = sub % 4u;
    let low = (vec4<u32>(w[base + 16u * n + 8u * (k % 2u) + j]) >> (lane + vec4<u32>(4u * (k / 2u)))) & vec4<u32>(15u);
    let high = (vec4<u32>(w[base + 32u + 8u * n + j]) >> (lane + vec4<u32>(2u * k))) & vec4<u32>(3u);
    let s = 8u * n + j / 4u + 2u * k;
    let sc = bitcast<i32>(w[base + 48u + s / 4u] << (24u - 8u * (s % 4u))) >> 24u;
    return f32(sc) * (vec4<f32>(low | (high << vec4<u32>(4u))) - vec4<f32>(32.0));
}

fn reduce(lid: u32, v: f32) -> f32 {
    partial[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s /= 2u) {
        if lid < s {
            partial[lid] += partial[lid + s];
        }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return total;
}

const FEW: u32 = 8u;              // up to this many tokens, matmul_few is used
const TILE_TOKENS: u32 = 8u;      // matmul_tiled: tokens of an invocation's tile

// matmul_tiled: weight rows of an invocation's tile, 32 for Q4_1 (x loads dominate) and 16 for
// the others (on lavapipe, Gemma's K-quants prefilled 12% slower with 32: more decoding live).
fn tile_rows() -> u32 {
    return select(16u, 32u, WEIGHT == 0u);
}

// The 4 nibbles of a Q4_1 word from bit `shift` of each byte (0: low, 4: high), as floats.
fn nibbles(word: u32, shift: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(word) >> (vec4<u32>(0u, 8u, 16u, 24u) + shift)) & vec4<u32>(15u));
}

// The 4 signed bytes of a Q8_0 word, as floats.
fn bytes4(word: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(word) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
}

// y[t, n] (+)= sum_k x[x_row0 + t, k] * W[n, k] for a few tokens (decode), K a multiple of
// 32: one invocation per 8 rows walks their weights block by block, for each token; each
// input vec4 is read once for the 8 rows and each weight word once per token. The sums run in
// `matmul_tiled`'s order, so a token's outputs are bit for bit those of a prefill.
@compute @workgroup_size(WG)
fn matmul_few(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n0 = flat_id(wg, lid) * 8u;
    if n0 >= dims.n {
        return;
    }
    let blocks = dims.k / 32u;
    let ba = row_blocks(n0);
    let bb = row_blocks(n0 + 4u);
    for (var t = 0u; t < dims.t; t++) {
        let q0 = (dims.x_row0 + t) * (dims.k / 4u);
        var acc_a = vec4<f32>();
        var acc_b = vec4<f32>();
        for (var blk = 0u; blk < blocks; blk++) {
            let q = q0 + 8u * blk;
            let rb_a = ba + vec4<u32>(blk);
            let rb_b = bb + vec4<u32>(blk);
            var s_a = vec4<f32>();
            var s_b = vec4<f32>();
            var xs = vec4<f32>();  // blocks with offsets: the inputs, summed per vec4
            for (var j = 0u; j < select(8u, 4u, WEIGHT == 0u); j++) {
                let x = x4[q + j];
                var x_hi = vec4<f32>();
                if WEIGHT == 0u {
                    x_hi = x4[q + 4u + j];
                    xs += x + x_hi;
                } else if has_offset() {
                    xs += x;
                }
                s_a += quad_dots(rb_a, j, x, x_hi);
                s_b += quad_dots(rb_b, j, x, x_hi);
            }
            let sx = dot(xs, vec4<f32>(1.0));
            let dma = scales4(rb_a);
            let dmb = scales4(rb_b);
            acc_a += dma[0] * s_a + dma[1] * sx;
            acc_b += dmb[0] * s_b + dmb[1] * sx;
        }
        store_rows(mat4x4<f32>(acc_a, vec4<f32>(), vec4<f32>(), vec4<f32>()), t, n0, 0u, 1u);
        store_rows(mat4x4<f32>(acc_b, vec4<f32>(), vec4<f32>(), vec4<f32>()), t, n0, 4u, 1u);
    }
}

// Where the weights of rows n .. n + 3 (clamped to the last row) start, for `quad_dots`,
// `quad_sums` and `scales4` (a block index added): each row's first block, or for row quads
// the quad's first block in every lane (n a multiple of 4; `quad_vecs()` vec4s a block).
fn row_blocks(n: u32) -> vec4<u32> {
    let last = dims.n - 1u;
    if row_quads() {
        return vec4<u32>((min(n, last) / 4u) * (dims.k / 32u));
    }
    return min(vec4<u32>(n) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(last)) * (dims.k / 32u);
}

// Per row r (column of w): dot(w[r], x).
fn row_dots(w: mat4x4<f32>, x: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(dot(w[0], x), dot(w[1], x), dot(w[2], x), dot(w[3], x));
}

// Word (Q4_1) or vec4 (Q8_0, f32) j of 4 rows' blocks rb against one token's inputs, per row:
// Q4_1's low nibbles against inputs j (`x`), its high ones against inputs 4 + j (`x_hi`).
fn quad_dots(rb: vec4<u32>, j: u32, x: vec4<f32>, x_hi: vec4<f32>) -> vec4<f32> {
    if WEIGHT == 0u {
        let words = quad_words(rb, j);
        return row_dots(nibble_rows(words, 0u), x) + row_dots(nibble_rows(words, 4u), x_hi);
    }
    return row_dots(rows4(rb, j), x);
}

// A row quad's sums for two token quads (a, b; columns: tokens).
struct TokenQuads {
    a: mat4x4<f32>,
    b: mat4x4<f32>,
}

// `quad_dots` for two token quads: inputs xa / xb (and xa_hi / xb_hi), columns t, token t.
fn quad_sums(rb: vec4<u32>, j: u32, xa: mat4x4<f32>, xa_hi: mat4x4<f32>, xb: mat4x4<f32>, xb_hi: mat4x4<f32>) -> TokenQuads {
    if WEIGHT == 0u {
        let words = quad_words(rb, j);
        let lo = nibble_rows(words, 0u);
        let hi = nibble_rows(words, 4u);
        return TokenQuads(dots(lo, xa) + dots(hi, xa_hi), dots(lo, xb) + dots(hi, xb_hi));
    }
    let w4 = rows4(rb, j);
    return TokenQuads(dots(w4, xa), dots(w4, xb));
}

// Inputs vec4 `at` of 4 tokens (x4 indices q of their blocks) as a matrix: column t, token t.
fn x_tile(q: vec4<u32>, at: u32) -> mat4x4<f32> {
    return mat4x4<f32>(x4[q.x + at], x4[q.y + at], x4[q.z + at], x4[q.w + at]);
}

// Code word j of a row quad's block b (`row_blocks` plus the block), one load.
fn quad_words(b: vec4<u32>, j: u32) -> vec4<u32> {
    return w4[quad_vecs() * b.x + 1u + j];
}

// The nibbles from bit `shift` of 4 rows' Q4_1 words as a matrix: column r, row r.
fn nibble_rows(words: vec4<u32>, shift: u32) -> mat4x4<f32> {
    return mat4x4<f32>(nibbles(words.x, shift), nibbles(words.y, shift), nibbles(words.z, shift), nibbles(words.w, shift));
}

// 4 weight rows' elements 4j .. 4j + 3 of their blocks b (`row_blocks` plus the block) before
// the blocks' scales, as a matrix: column r, row r (Q8_0: signed bytes; Q4_0, Q5_0, Q5_1,
// K-quants: `codes4`; f32: the weights; Q4_1 goes through `quad_words` and `nibble_rows`, one load per
// word for both halves).
fn rows4(b: vec4<u32>, j: u32) -> mat4x4<f32> {
    if WEIGHT == 1u {
        let v = quad_words(b, j);
        return mat4x4<f32>(bytes4(v.x), bytes4(v.y), bytes4(v.z), bytes4(v.w));
    } else if WEIGHT >= 3u {
        return mat4x4<f32>(codes4(b.x, j), codes4(b.y, j), codes4(b.z, j), codes4(b.w, j));
    }
    let e = 32u * b + vec4<u32>(4u * j);
    return mat4x4<f32>(
        bitcast<vec4<f32>>(vec4<u32>(w[e.x], w[e.x + 1u], w[e.x + 2u], w[e.x + 3u])),
        bitcast<vec4<f32>>(vec4<u32>(w[e.y], w[e.y + 1u], w[e.y + 2u], w[e.y + 3u])),
        bitcast<vec4<f32>>(vec4<u32>(w[e.z], w[e.z + 1u], w[e.z + 2u], w[e.z + 3u])),
        bitcast<vec4<f32>>(vec4<u32>(w[e.w], w[e.w + 1u], w[e.w + 2u], w[e.w + 3u])));
}

// 4 rows' block scales (column 0) and offsets (column 1; 0 where blocks have none), per row
// (b: `row_blocks` plus the block).
fn scales4(b: vec4<u32>) -> mat2x4<f32> {
    if WEIGHT == 0u {
        let dm = w4[quad_vecs() * b.x];
        let a = unpack2x16float(dm.x);
        let c = unpack2x16float(dm.y);
        let d = unpack2x16float(dm.z);
        let e = unpack2x16float(dm.w);
        return mat2x4<f32>(vec4<f32>(a.x, c.x, d.x, e.x), vec4<f32>(a.y, c.y, d.y, e.y));
    } else if WEIGHT == 1u {
        let d = w4[quad_vecs() * b.x];
        return mat2x4<f32>(vec4<f32>(unpack2x16float(d.x).x, unpack2x16float(d.y).x,
                                     unpack2x16float(d.z).x, unpack2x16float(d.w).x), vec4<f32>(0.0));
    } else if WEIGHT >= 3u {
        let a = block_scale(b.x);
        let c = block_scale(b.y);
        let d = block_scale(b.z);
        let e = block_scale(b.w);
        return mat2x4<f32>(vec4<f32>(a.x, c.x, d.x, e.x), vec4<f32>(a.y, c.y, d.y, e.y));
    }
    return mat2x4<f32>(vec4<f32>(1.0), vec4<f32>(0.0));
}

// Per token t (column of x) and row r (column of w): dot(w[r], x[t]); column t of the result.
fn dots(w: mat4x4<f32>, x: mat4x4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(
        vec4<f32>(dot(w[0], x[0]), dot(w[1], x[0]), dot(w[2], x[0]), dot(w[3], x[0])),
        vec4<f32>(dot(w[0], x[1]), dot(w[1], x[1]), dot(w[2], x[1]), dot(w[3], x[1])),
        vec4<f32>(dot(w[0], x[2]), dot(w[1], x[2]), dot(w[2], x[2]), dot(w[3], x[2])),
        vec4<f32>(dot(w[0], x[3]), dot(w[1], x[3]), dot(w[2], x[3]), dot(w[3], x[3])));
}

// Scaled block sums: column t of s (token t's raw sums per row) times the rows' scales, plus
// their offsets times the token's input sum sx[t].
fn scaled(s: mat4x4<f32>, dm: mat2x4<f32>, sx: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(dm[0] * s[0] + dm[1] * sx.x, dm[0] * s[1] + dm[1] * sx.y,
                       dm[0] * s[2] + dm[1] * sx.z, dm[0] * s[3] + dm[1] * sx.w);
}

// Stores column t < `cols` of a tile's accumulator (4 rows from n0 + r0) for token t0 + t.
fn store_rows(acc: mat4x4<f32>, t0: u32, n0: u32, r0: u32, cols: u32) {
    for (var t = 0u; t < min(cols, dims.t - min(t0, dims.t)); t++) {
        let col = acc[t];
        for (var r = 0u; r < min(4u, dims.n - min(n0 + r0, dims.n)); r++) {
            let at = y_at(t0 + t, n0 + r0 + r);
            if ACCUMULATE {
                y[at] += col[r];
            } else {
                y[at] = col[r];
            }
        }
    }
}

// Two row quads' sums added, token quad by token quad.
fn add_quads(s: TokenQuads, t: TokenQuads) -> TokenQuads {
    return TokenQuads(s.a + t.a, s.b + t.b);
}

// `scaled` for both token quads (input sums sxa, sxb).
fn scaled_quads(s: TokenQuads, dm: mat2x4<f32>, sxa: vec4<f32>, sxb: vec4<f32>) -> TokenQuads {
    return TokenQuads(scaled(s.a, dm, sxa), scaled(s.b, dm, sxb));
}

// Stores a row quad's sums (rows n0 + r0 ..) for tokens t0 .. t0 + 7.
fn store_quads(acc: TokenQuads, t0: u32, n0: u32, r0: u32) {
    store_rows(acc.a, t0, n0, r0, 4u);
    store_rows(acc.b, t0 + 4u, n0, r0, 4u);
}

// y[t, n] (+)= sum_k x[x_row0 + t, k] * W[n, k] for passes of many tokens (prefill, eval,
// capture), K a multiple of 32: one invocation per tile of 32 or 16 rows x 8 tokens
// (`tile_rows()` x `TILE_TOKENS`) walks the rows' weights block by block; each input vec4 is
// read once for the tile's rows and each weight word decoded once for its 8 tokens. Rows and
// tokens past the ends repeat the last one and are not stored. The row quads a..h are spelled
// out, not an array: a CPU rasterizer keeps an array indexed in a loop in memory (prefill ran
// at a third of the speed that way on lavapipe). Quads e..h only run in tiles of 32 rows.
@compute @workgroup_size(WG)
fn matmul_tiled(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let id = flat_id(wg, lid);
    let row_tiles = (dims.n + tile_rows() - 1u) / tile_rows();
    let n0 = (id % row_tiles) * tile_rows();
    let t0 = (id / row_tiles) * TILE_TOKENS;
    if t0 >= dims.t {
        return;
    }
    let lane = vec4<u32>(0u, 1u, 2u, 3u);
    let blocks = dims.k / 32u;
    let last_tok = vec4<u32>(dims.t - 1u);
    let qa0 = (vec4<u32>(dims.x_row0) + min(vec4<u32>(t0) + lane, last_tok)) * (dims.k / 4u);
    let qb0 = (vec4<u32>(dims.x_row0) + min(vec4<u32>(t0 + 4u) + lane, last_tok)) * (dims.k / 4u);
    // First blocks of the row quads (rows n0 + 4i .. n0 + 4i + 3 for quad i = a, b, ..., h).
    let ba = row_blocks(n0);
    let bb = row_blocks(n0 + 4u);
    let bc = row_blocks(n0 + 8u);
    let bd = row_blocks(n0 + 12u);
    let be = row_blocks(n0 + 16u);
    let bf = row_blocks(n0 + 20u);
    let bg = row_blocks(n0 + 24u);
    let bh = row_blocks(n0 + 28u);
    // acc_<quad>: the row quad's sums for token quads a (t0 ..) and b (t0 + 4 ..).
    var acc_a = TokenQuads();
    var acc_b = TokenQuads();
    var acc_c = TokenQuads();
    var acc_d = TokenQuads();
    var acc_e = TokenQuads();
    var acc_f = TokenQuads();
    var acc_g = TokenQuads();
    var acc_h = TokenQuads();
    for (var blk = 0u; blk < blocks; blk++) {
        let qa = qa0 + vec4<u32>(8u * blk);
        let qb = qb0 + vec4<u32>(8u * blk);
        var s_a = TokenQuads();
        var s_b = TokenQuads();
        var s_c = TokenQuads();
        var s_d = TokenQuads();
        var s_e = TokenQuads();
        var s_f = TokenQuads();
        var s_g = TokenQuads();
        var s_h = TokenQuads();
        var xs_a = mat4x4<f32>();  // blocks with offsets: the tokens' inputs, summed per vec4
        var xs_b = mat4x4<f32>();
        // The same sums in the same order as `matmul_few`, so a token's outputs are bit for bit
        // those of decode: a prefill or an eval chunk puts exactly the K/V into the cache that
        // token-by-token decode would (codes would round apart otherwise).
        for (var j = 0u; j < select(8u, 4u, WEIGHT == 0u); j++) {
            let xa = x_tile(qa, j);
            let xb = x_tile(qb, j);
            var xa_hi = mat4x4<f32>();
            var xb_hi = mat4x4<f32>();
            if WEIGHT == 0u {
                xa_hi = x_tile(qa, 4u + j);
                xb_hi = x_tile(qb, 4u + j);
                xs_a += xa + xa_hi;
                xs_b += xb + xb_hi;
            } else if has_offset() {
                xs_a += xa;
                xs_b += xb;
            }
            s_a = add_quads(s_a, quad_sums(ba + vec4<u32>(blk), j, xa, xa_hi, xb, xb_hi));
            s_b = add_quads(s_b, quad_sums(bb + vec4<u32>(blk), j, xa, xa_hi, xb, xb_hi));
            s_c = add_quads(s_c, quad_sums(bc + vec4<u32>(blk), j, xa, xa_hi, xb, xb_hi));
            s_d = add_quads(s_d, quad_sums(bd + vec4<u32>(blk), j, xa, xa_hi, xb, xb_hi));
            if tile_rows() == 32u {
                s_e = add_quads(s_e, quad_sums(be + vec4<u32>(blk), j, xa, xa_hi, xb, xb_hi));
                s_f = add_quads(s_f, quad_sums(bf + vec4<u32>(blk), j, xa, xa_hi, xb, xb_hi));
                s_g = add_quads(s_g, quad_sums(bg + vec4<u32>(blk), j, xa, xa_hi, xb, xb_hi));
                s_h = add_quads(s_h, quad_sums(bh + vec4<u32>(blk), j, xa, xa_hi, xb, xb_hi));
            }
        }
        let one = vec4<f32>(1.0);
        let sxa = vec4<f32>(dot(xs_a[0], one), dot(xs_a[1], one), dot(xs_a[2], one), dot(xs_a[3], one));
        let sxb = vec4<f32>(dot(xs_b[0], one), dot(xs_b[1], one), dot(xs_b[2], one), dot(xs_b[3], one));
        acc_a = add_quads(acc_a, scaled_quads(s_a, scales4(ba + vec4<u32>(blk)), sxa, sxb));
        acc_b = add_quads(acc_b, scaled_quads(s_b, scales4(bb + vec4<u32>(blk)), sxa, sxb));
        acc_c = add_quads(acc_c, scaled_quads(s_c, scales4(bc + vec4<u32>(blk)), sxa, sxb));
        acc_d = add_quads(acc_d, scaled_quads(s_d, scales4(bd + vec4<u32>(blk)), sxa, sxb));
        if tile_rows() == 32u {
            acc_e = add_quads(acc_e, scaled_quads(s_e, scales4(be + vec4<u32>(blk)), sxa, sxb));
            acc_f = add_quads(acc_f, scaled_quads(s_f, scales4(bf + vec4<u32>(blk)), sxa, sxb));
            acc_g = add_quads(acc_g, scaled_quads(s_g, scales4(bg + vec4<u32>(blk)), sxa, sxb));
            acc_h = add_quads(acc_h, scaled_quads(s_h, scales4(bh + vec4<u32>(blk)), sxa, sxb));
        }
    }
    store_quads(acc_a, t0, n0, 0u);
    store_quads(acc_b, t0, n0, 4u);
    store_quads(acc_c, t0, n0, 8u);
    store_quads(acc_d, t0, n0, 12u);
    if tile_rows() == 32u {
        store_quads(acc_e, t0, n0, 16u);
        store_quads(acc_f, t0, n0, 20u);
        store_quads(acc_g, t0, n0, 24u);
        store_quads(acc_h, t0, n0, 28u);
    }
}

// `matmul_few` for any K: weight by weight, every token at once.
@compute @workgroup_size(WG)
fn matmul_few_any(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n = flat_id(wg, lid);
    if n >= dims.n {
        return;
    }
    var acc: array<f32, FEW>;
    for (var t = 0u; t < FEW; t++) {
        acc[t] = 0.0;
    }
    for (var e = 0u; e < dims.k; e++) {
        let v = weight(n, e);
        for (var t = 0u; t < dims.t; t++) {
            acc[t] += x[(dims.x_row0 + t) * dims.k + e] * v;
        }
    }
    for (var t = 0u; t < dims.t; t++) {
        if ACCUMULATE {
            y[y_at(t, n)] += acc[t];
        } else {
            y[y_at(t, n)] = acc[t];
        }
    }
}

// y[t, n] (+)= sum_k x[x_row0 + t, k] * W[n, k] for many tokens (K <= TILE_K): one workgroup
// per output row n; the row is dequantized once into workgroup memory, then dotted with every
// token's input.
@compute @workgroup_size(WG)
fn matmul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n = wg.y * dims.grid_x + wg.x;
    if n >= dims.n {
        return;
    }
    for (var e = lid; e < dims.k; e += WG) {
        row[e] = weight(n, e);
    }
    workgroupBarrier();
    for (var t = lid; t < dims.t; t += WG) {
        let base = (dims.x_row0 + t) * dims.k;
        var acc = 0.0;
        for (var e = 0u; e < dims.k; e++) {
            acc += x[base + e] * row[e];
        }
        if ACCUMULATE {
            y[y_at(t, n)] += acc;
        } else {
            y[y_at(t, n)] = acc;
        }
    }
}

// `matmul` for any K: the row goes through workgroup memory TILE_K elements at a time, each
// tile dotted with every token's input; past the first tile a token's sum accumulates in
// y[t, n], which one invocation owns throughout. (Its own entry point: the loop around the
// barriers costs `matmul` ~5% on lavapipe.)
@compute @workgroup_size(WG)
fn matmul_tiles(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n = wg.y * dims.grid_x + wg.x;
    if n >= dims.n {
        return;
    }
    for (var k0 = 0u; k0 < dims.k; k0 += TILE_K) {
        let kn = min(TILE_K, dims.k - k0);
        workgroupBarrier(); // every invocation is done with the previous tile
        for (var e = lid; e < kn; e += WG) {
            row[e] = weight(n, k0 + e);
        }
        workgroupBarrier();
        for (var t = lid; t < dims.t; t += WG) {
            let base = (dims.x_row0 + t) * dims.k + k0;
            var acc = 0.0;
            for (var e = 0u; e < kn; e++) {
                acc += x[base + e] * row[e];
            }
            if ACCUMULATE || k0 > 0u {
                y[y_at(t, n)] += acc;
            } else {
                y[y_at(t, n)] = acc;
            }
        }
    }
}

// y[t, :] (+)= x[x_row0 + t, :] / rms * gain: one workgroup per row (a token, or a head of
// dims.k channels for Q/K norms).
@compute @workgroup_size(WG)
fn rmsnorm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wg.y * dims.grid_x + wg.x;
    if t >= dims.t {
        return;
    }
    let base = (dims.x_row0 + t) * dims.k;
    var acc = 0.0;
    for (var e = lid; e < dims.k; e += WG) {
        acc += x[base + e] * x[base + e];
    }
    let inv = 1.0 / sqrt(reduce(lid, acc) / f32(dims.k) + dims.eps);
    for (var e = lid; e < dims.k; e += WG) {
        let i = t * dims.k + e;
        let prev = select(0.0, y[i], ACCUMULATE);
        y[i] = prev + x[base + e] * inv * norm_w[e];
    }
}

// Token embeddings: y[t, :] = row tokens[t] of the weights · dims.scale (dims.k = hidden).
// A part of a split embedding holds rows [n0, n0 + n) and writes only the tokens it holds.
@compute @workgroup_size(WG)
fn embed(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = flat_id(wg, lid);
    if i >= dims.t * dims.k {
        return;
    }
    let t = i / dims.k;
    let row = tokens[t] - dims.n0;
    if tokens[t] < dims.n0 || row >= dims.n {
        return;
    }
    y[i] = weight(row, i % dims.k) * dims.scale;
}

// [T, heads * D] -> [heads, T, D], rotating pair i by pos * theta^(-2i/D): adjacent
// channels (x[2i], x[2i+1]) (llama.cpp's normal RoPE; GGUF permutes llama's Q/K rows for it),
// or with HALVES (x[i], x[i + D/2]) (NEOX: gemma3).
@compute @workgroup_size(WG)
fn rope(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = flat_id(wg, lid);
    let pairs = dims.head_dim / 2u;
    if i >= dims.t * dims.heads * pairs {
        return;
    }
    let p = i % pairs;
    let h = (i / pairs) % dims.heads;
    let t = i / (pairs * dims.heads);
    // Channels of the pair within the head: (2p, 2p + 1), or (p, p + D/2).
    let ca = select(2u * p, p, HALVES);
    let cb = select(2u * p + 1u, p + pairs, HALVES);
    let src = (t * dims.heads + h) * dims.head_dim;
    let dst = (h * dims.t + t) * dims.head_dim;
    var a = x[src + ca];
    var b = x[src + cb];
    if ROTATE {
        let angle = f32(dims.pos0 + t) * pow(dims.theta, -f32(2u * p) / f32(dims.head_dim));
        let c = cos(angle);
        let s = sin(angle);
        let ra = a * c - b * s;
        b = a * s + b * c;
        a = ra;
    }
    y[dst + ca] = a;
    y[dst + cb] = b;
}

// The gated FFN's activation in place: y[i] = act(y[i]) * x[i] (y: gate, x: up); act is
// SiLU (SwiGLU) or, with GELU, GELU's tanh approximation (GeGLU).
@compute @workgroup_size(WG)
fn gated(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = flat_id(wg, lid);
    if i >= dims.t * dims.n {
        return;
    }
    let g = y[i];
    var a: f32;
    if GELU {
        // tanh(u) as 1 - 2 / (exp(2u) + 1): no overflow to NaN for large |u|.
        let u = 0.7978846 * (g + 0.044715 * g * g * g);
        a = 0.5 * g * (2.0 - 2.0 / (exp(2.0 * u) + 1.0));
    } else {
        a = g / (1.0 + exp(-g));
    }
    y[i] = a * x[i];
}
