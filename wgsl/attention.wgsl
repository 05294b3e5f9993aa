// Split-K (flash-decoding) attention over a cache's K/V, read where they live: quantized
// blocks of a page (packed codes + params, and a reuse layer's residual) or the f16 window
// ring (also the whole of an f16 cache). One workgroup per (row, chunk of tokens, tile of
// queries) writes one partial per query: the running max m, the sum of exp l and the
// unnormalised weighted values; `combine` merges the partials of every chunk of every
// dispatch of one attention call into the output, and a call of one chunk in all writes its
// output directly (DIRECT). A dispatch reads up to two *segments* one after the other: a
// quantized block (`attend_block`) and the f16 ring (WITH_RING; `attend_ring` reads only it):
// the f16 sinks, which live in the ring buffers after the ring's slots, then the window's
// tokens, one sequence read by one code path. Each segment is padded to whole runs of TT
// tokens and the chunks (`dims.span` tokens each, at most CHUNK) cut the padded sequence, so
// a short context (a block, the sinks and the window within one chunk) is one workgroup per
// (row, query tile): one dispatch, no partials, no combine. A value-phase thread adds the
// ring's values of its channels to the block's before it writes them.
//
// Rows r = b * kv_heads + kvh index the cache's K/V [R, tokens, D]. The queries attending
// row r are the q_per_row = (q_heads / kv_heads) * T pairs (head, token) of the KV head's
// query heads: query qi is head kvh * gqa + qi / T, token qi % T, at absolute position
// pos0 + qi % T; it sees cached tokens at positions <= its own (causal decode).
//
// The algebra that makes codes cheap. Keys grouped along tokens: k[j, d] = s[g, d] * c[j, d]
// + z[g, d] (+ the residual's rs * rc + rz), so the scale folds into the query, q' = q * s,
// and the zero into one bias per group, sum_d q[d] * z[g, d]: q . k is a sum of small integers
// times floats. Values grouped along tokens: sum_j p[j] v[j, d] = s[g, d] * sum_j p[j] c[j, d]
// + z[g, d] * sum_j p[j]: codes weighted by the probabilities, scale and zero once per group.
// Grouped along D (per token), the same algebra runs the other way: keys, q . k[j] =
// sum_g s[j, g] * (q . c[j, g]) + z[j, g] * sum_{d in g} q[d], so codes meet the queries first
// and each token's params apply once per group; values, sum_j p[j] v[j, d] = sum_j (p[j]
// s[j, g]) c[j, d] + sum_j p[j] z[j, g]: the token's scale folds into its probability and its
// zero into one bias per group. Only groups that are not a multiple of 4 (GENERIC) dequantize
// element by element. Everything accumulates in f32.
//
// Work is laid out to read each word once and to waste no lanes: a key-phase thread owns a
// run of TT tokens whose codes share a word (or two) per channel and works on 4 consecutive
// tokens per vec4, for each of the QT (<= 4) queries of the workgroup; a value-phase thread
// owns 4 channels and reads each 4 tokens' probabilities once for all of them.
//
// Layouts of codes and params: src/layout.rs. A page's own data lives in one buffer ("meta":
// params, own codes, residual params, residual codes at word offsets); a reuse layer's codes
// are its anchor's page codes (a second binding).

struct Side {
    groups: u32,      // groups per row of the page
    other: u32,       // O of the page: D (grouped along tokens) or page tokens (along D)
    wpg: u32,         // words per group of codes
    rwpg: u32,        // words per group of residual codes
    params: u32,      // word offset of the params in the meta buffer
    res_params: u32,  // word offset of the residual params in the meta buffer
    res_codes: u32,   // word offset of the residual codes in the meta buffer
    codes: u32,       // word offset of the codes in the codes buffer
}

struct Dims {
    rows: u32,          // R = batch * kv_heads
    kv_heads: u32,
    q_heads: u32,       // query heads (a multiple of kv_heads)
    q_tokens: u32,      // T: query tokens per head
    q_per_row: u32,     // (q_heads / kv_heads) * T
    tiles: u32,         // ceil(q_per_row / QT)
    pos0: u32,          // absolute position of query token 0
    scale: f32,         // softmax scale, usually 1 / sqrt(D)
    n: u32,             // attend_block: tokens of the block (attend_ring: 0)
    abs0: u32,          // attend_block: absolute position of the block's token 0
    chunks: u32,        // chunks of this dispatch: its segments padded to runs, / span
    slot0: u32,         // partial slot of chunk 0
    slots: u32,         // partial slots per query, all dispatches of this call
    grid_x: u32,        // workgroups along x
    t0: u32,            // attend_block: page token of the block's token 0
    ring_tokens: u32,   // WITH_RING: token slots per row of the ring
    k: Side,
    v: Side,
    out_batch: u32,     // combine: output element strides of batch, head and token
    out_head: u32,
    out_token: u32,
    ring_n: u32,        // WITH_RING: tokens of the window ring
    ring_t0: u32,       // WITH_RING: the slot of their first ring token
    ring_abs0: u32,     // WITH_RING: the absolute position of that token
    sink_n: u32,        // WITH_RING: the sinks before the window's tokens (absolute positions 0..)
    sink_tokens: u32,   // WITH_RING: token slots per row of the sinks
    sink_word: u32,     // WITH_RING: the sinks' first word in the rings [R, sink_tokens, D_even / 2]
    rot_seed: u32,      // ROTATE_Q / ROTATE_OUT: the rotation's seed
    q_stream: u32,      // ROTATE_Q: the keys' sign streams (high bits; | KV head)
    o_stream: u32,      // ROTATE_OUT: the values' sign streams
    window: u32,        // a sliding window: query p sees positions p' with p - p' < window (0: all)
    span: u32,          // tokens per chunk of this dispatch (a multiple of TT, at most CHUNK)
    _pad2: u32,
    _pad3: u32,
    k_levels: array<vec4<f32>, 4>, // K_LEVELS: the keys' 2^K_BITS Lloyd-Max levels
    v_levels: array<vec4<f32>, 4>, // V_LEVELS: the values'
}

override WG: u32 = 32u;
override DIM: u32 = 64u;           // D
override GROUP: u32 = 32u;         // members per quantization group
override CHUNK: u32 = 512u;        // most tokens per workgroup (a multiple of TT): `prob`'s size
override TT: u32 = 16u;            // tokens per key-phase thread: a multiple of 4 dividing GROUP,
                                   // TT * bits <= 32 (their codes sit in one 32-bit window;
                                   // keys without a residual and residuals that fit, two words
                                   // (`run_window`): TT 16 at 3-4 bits; a wider residual is
                                   // read a window per 4 tokens)
override QT: u32 = 4u;             // queries per workgroup (<= 4: one vec4 of them)
override CV: u32 = 4u;             // channels per value-phase thread of values grouped along D
                                   // (4, 8 or 16, dividing GROUP, CV * bits <= 32: one window)
override VP: u32 = 1u;             // value-phase threads a block of CV channels' tokens are
                                   // split over (`token_values`)
override RC: u32 = 4u;             // channels per value-phase thread of a ring alone: 4, 8 (D a
                                   // multiple of 8, RP = 1: a token's addresses and
                                   // probabilities serve twice the channels) or 16 (D a
                                   // multiple of 16, split over RP threads)
override RP: u32 = 1u;             // value-phase threads a block of 4 or 16 ring channels'
                                   // tokens are split over (`ring_values`)
override SPLIT_BLOCK: bool = false; // values grouped along tokens split a block of 4 channels'
                                   // tokens, with its ring's, over RP threads too (RC = 4)
override CK: u32 = 4u;             // channels per code window of keys grouped along D (likewise)
override GENERIC: bool = false;    // GROUP is not a multiple of 4: read every token's codes apart
override K_BITS: u32 = 2u;
override K_RES_BITS: u32 = 4u;
override K_RESIDUAL: bool = false; // keys: add the residual (a reuse layer's shared block)
override K_CHANNELS: bool = false; // keys grouped along D
override V_BITS: u32 = 2u;
override V_RES_BITS: u32 = 4u;
override V_RESIDUAL: bool = false;
override V_CHANNELS: bool = false; // values grouped along D (per token)
override PARAMS_F32: bool = false;
override Q_F16: bool = false;      // queries are f16 pairs
override OUT_F16: bool = false;    // the output holds f16 pairs
override DIRECT: bool = false;     // the call has one chunk in all: write the output, no partials
override WITH_RING: bool = false;  // the ring (sinks, then the window) is a segment of this dispatch
override OWN_CODES: bool = false;  // attend_block: the codes are the page's own (in k_meta),
                                   // k_aux / v_aux are unused
override ROTATE_Q: bool = false;   // the cache's keys are rotated: rotate the queries as loaded
override ROTATE_OUT: bool = false; // its values are: rotate the output back as it is written
                                   // (DIRECT attend entries and combine)
override K_LEVELS: bool = false;   // the keys' codes index Lloyd-Max levels, x = norm * level
                                   // (grouped along D; params: one norm per cell)
override V_LEVELS: bool = false;   // the values' codes do
override TOKEN_QUADS: bool = false; // a block's first token and the token counts of its sides
                                   // grouped along D are multiples of 4: 4 tokens' words from
                                   // a multiple of 4 are one vec4 (`windows4`, `params4`)

const TT_MAX: u32 = 16u;           // TT's upper bound (slow_scores holds a run)
const NEG: f32 = -3.0e38;          // "no score": masked tokens, empty partials

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> queries: array<u32>;  // [B, q_heads, T, D] f32 bits or f16 pairs
// Page buffers are read 4 words at a time (`meta_quad`; a lone word through the view,
// `meta_word`): their sections start at 256-byte boundaries and the buffers are whole
// sections.
@group(0) @binding(2) var<storage, read> k_meta: array<vec4<u32>>;   // key page sections
// Key codes [R, groups, wpg, O] of a reuse block (its anchor's page codes; unused with
// OWN_CODES or in `attend_ring`).
@group(0) @binding(3) var<storage, read> k_aux: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> v_meta: array<vec4<u32>>;   // value page sections
@group(0) @binding(5) var<storage, read> v_aux: array<vec4<u32>>;    // value codes
// [R, q_per_row, slots, D + 2] f32 bits: acc[D], m, l. DIRECT: the output itself (f32 bits or
// f16 pairs at the strides), so the attend entries use one writable binding.
@group(0) @binding(6) var<storage, read_write> partials: array<u32>;
@group(0) @binding(7) var<storage, read_write> out: array<u32>;      // combine: f32 bits or f16 pairs at the strides
// The key ring [R, ring_tokens, D_even / 2] f16 pairs, then (at sink_word) the key sinks
// [R, sink_tokens, D_even / 2], read 4 words at a time (`ring_quads`; a lone word through the
// view, `ring_word`): a ring's
// buffer is a whole number of vec4s, its rows start at vec4s where D is a multiple of 8, and
// its sinks at a section boundary.
@group(0) @binding(8) var<storage, read> k_ring: array<vec4<u32>>;
@group(0) @binding(9) var<storage, read> v_ring: array<vec4<u32>>;   // the value ring and sinks

// The tile's queries times the scale, qs[d] = (query q0 .. q0 + 3 at channel d); the chunk's
// scores, then probabilities, in vec4s of 4 consecutive tokens, prob[q * CHUNK / 4 + j / 4];
// the softmax's per-thread maxima and sums (stat[t], stat[WG + t]: vec4s over the queries),
// then (DIRECT) the queries' m and l in stat[0] and stat[1].
var<workgroup> qs: array<vec4<f32>, DIM>;
var<workgroup> prob: array<vec4<f32>, 4u * CHUNK / 4u>;
var<workgroup> stat: array<vec4<f32>, 2u * WG>;

// The workgroup's row, chunk and query tile, and (from `segment`) one segment's tokens in
// its chunk.
struct Work {
    r: u32,
    chunk: u32, // chunk of the dispatch (its partial slot is slot0 + chunk)
    q0: u32,    // first query of the tile
    nq: u32,    // queries in the tile
    v0: u32,    // the chunk's first padded token (chunk * span)
    vn: u32,    // the chunk's padded tokens (a multiple of TT)
    j0: u32,    // segment: its first token in this chunk, counted in its source
    nj: u32,    // segment: its tokens in this chunk
    t0: u32,    // segment: the source's token 0: page token (block) or ring token (ring)
    abs0: u32,  // segment: absolute position of the source's token 0
    lead: u32,  // segment: sinks before the source's tokens (the ring's; positions 0..lead)
    p0: u32,    // segment: its first score vec4 in `prob` (its offset in the chunk / 4)
    valid: bool,
}

const BLOCK: u32 = 0u;
const RING: u32 = 1u;

// Tokens of a segment of this dispatch (the ring's: its sinks, then the window's).
fn seg_tokens(kind: u32) -> u32 {
    if kind == BLOCK {
        return dims.n;
    }
    return select(0u, dims.sink_n + dims.ring_n, WITH_RING);
}

// n tokens padded to whole runs.
fn padded(n: u32) -> u32 {
    return (n + TT - 1u) / TT * TT;
}

// The segment `kind` of the workgroup's chunk (nj = 0: none of its tokens).
fn segment(c: Work, kind: u32) -> Work {
    var w = c;
    let start = select(0u, padded(seg_tokens(BLOCK)), kind == RING);
    let n = seg_tokens(kind);
    let lo = max(c.v0, start);
    let hi = min(c.v0 + c.vn, start + padded(n));
    w.j0 = 0u;
    w.nj = 0u;
    w.p0 = 0u;
    if hi > lo {
        w.j0 = lo - start;
        w.nj = min(hi, start + n) - min(lo, start + n);
        w.p0 = (lo - c.v0) / 4u;
    }
    w.t0 = dims.t0;
    w.abs0 = dims.abs0;
    w.lead = 0u;
    if kind == RING {
        w.t0 = dims.ring_t0;
        w.abs0 = dims.ring_abs0;
        w.lead = dims.sink_n;
    }
    return w;
}

// Absolute positions of the segment's tokens v (counted in the segment): the sinks', then
// the source's from abs0.
fn positions(w: Work, v: vec4<u32>) -> vec4<u32> {
    let lead = vec4<u32>(w.lead);
    return select(vec4<u32>(w.abs0) + v - lead, v, v < lead);
}

fn work_of(wg: vec3<u32>) -> Work {
    var w: Work;
    let id = wg.y * dims.grid_x + wg.x;
    let tile = id % dims.tiles;
    w.chunk = (id / dims.tiles) % dims.chunks;
    w.r = id / (dims.tiles * dims.chunks);
    w.valid = w.r < dims.rows;
    w.q0 = tile * QT;
    w.nq = min(QT, dims.q_per_row - min(w.q0, dims.q_per_row));
    let ring_start = padded(seg_tokens(BLOCK));
    let total = ring_start + padded(seg_tokens(RING));
    w.v0 = w.chunk * dims.span;
    w.vn = min(dims.span, total - min(w.v0, total));
    // Causal: the chunk ends with the window ring's run holding the tile's newest position, so
    // a prefill's tile neither scores nor weighs the ring tokens it cannot see. (The ring is
    // the last segment, so what is cut off is the chunk's tail.)
    if WITH_RING {
        let last = tile_last_pos(w);
        let seen = select(0u, last + 1u - dims.ring_abs0, last >= dims.ring_abs0);
        let end = ring_start + padded(dims.sink_n + seen);
        if seen < dims.ring_n && end > w.v0 {
            w.vn = min(w.vn, end - w.v0);
        }
    }
    return w;
}

// The absolute position of the chunk's first token.
fn chunk_first_pos(c: Work) -> u32 {
    var first = 0xffffffffu;
    for (var k = 0u; k < 2u; k++) {
        let s = segment(c, k);
        if s.nj > 0u {
            first = min(first, positions(s, vec4<u32>(s.j0)).x);
        }
    }
    return first;
}

// Element (b, h, t, 0) of the queries for query qi of row r; NO_QUERY past the last query.
const NO_QUERY: u32 = 0xffffffffu;
fn query_base(r: u32, qi: u32) -> u32 {
    if qi >= dims.q_per_row {
        return NO_QUERY;
    }
    let gqa = dims.q_heads / dims.kv_heads;
    let b = r / dims.kv_heads;
    let h = (r % dims.kv_heads) * gqa + qi / dims.q_tokens;
    return ((b * dims.q_heads + h) * dims.q_tokens + qi % dims.q_tokens) * DIM;
}

// Channel d of the query at `base` (query_base), scaled; 0 for NO_QUERY.
fn query_at(base: u32, d: u32) -> f32 {
    if base == NO_QUERY {
        return 0.0;
    }
    let e = base + d;
    var v: f32;
    if Q_F16 {
        v = unpack2x16float(queries[e >> 1u])[e & 1u];
    } else {
        v = bitcast<f32>(queries[e]);
    }
    return v * dims.scale;
}

// Absolute position of query q of the tile (past the last query: sees everything).
fn query_pos(w: Work, q: u32) -> u32 {
    let qi = w.q0 + q;
    return select(0xffffffffu, dims.pos0 + qi % dims.q_tokens, qi < dims.q_per_row);
}

// The newest position any query of the tile sees.
fn tile_last_pos(w: Work) -> u32 {
    var last = 0u;
    for (var i = 0u; i < w.nq; i++) {
        last = max(last, dims.pos0 + (w.q0 + i) % dims.q_tokens);
    }
    return last;
}

// ---- The Hadamard rotation of a rotated cache (wgsl/rotate.wgsl, reference/rotation.rs):
// R x = H (s ⊙ x) / √D with signs s hashed per stream, and R⁻¹ y = s ⊙ (H y) / √D. H runs
// over `qs` (the 4 vectors of a tile, one per column) in workgroup memory as butterfly
// stages, two at a time: the stages of H (one per bit of the channel index) commute, so a
// thread applies the stages of bits b and b + 1 to the 4 elements those bits select in
// registers, and log2(D) stages take log2(D) / 2 barriers (each element is read once per
// pass; a row of H per element would read every element D times).

fn mix(a: u32) -> u32 {
    var h = a;
    h ^= h >> 16u;
    h *= 0x7feb352du;
    h ^= h >> 15u;
    h *= 0x846ca68bu;
    h ^= h >> 16u;
    return h;
}

fn sign_of(stream: u32, d: u32) -> f32 {
    return select(1.0, -1.0, (mix(dims.rot_seed ^ mix(stream ^ mix(d))) & 1u) == 1u);
}

// The 4-point Hadamard transform (the stages of two bits) of the elements j, j + h, j + 2h
// and j + 3h in e[0..3]: e[0] and e[1] differ in the lower bit, e[0] and e[2] in the higher.
fn hadamard4(e: mat4x4<f32>) -> mat4x4<f32> {
    let a0 = e[0] + e[1];
    let a1 = e[0] - e[1];
    let a2 = e[2] + e[3];
    let a3 = e[2] - e[3];
    return mat4x4<f32>(a0 + a2, a1 + a3, a0 - a2, a1 - a3);
}

// qs ← (the stages of bits log2(h0) ..) qs: the stages of bits below h0 are the caller's
// (`hadamard_qs(lid, 1u)` is H). Called in uniform control flow; begins and ends with a
// barrier.
fn hadamard_qs(lid: u32, h0: u32) {
    for (var h = h0; h < DIM; h *= 4u) {
        workgroupBarrier();
        hadamard_stage(lid, h);
    }
    workgroupBarrier();
}

// The butterflies of bit log2(h) of qs, and of the next bit too (radix 4) while 2h < D.
fn hadamard_stage(lid: u32, h: u32) {
    if 2u * h < DIM {
        for (var p = lid; p < DIM / 4u; p += WG) {
            let j = (p / h) * 4u * h + p % h;
            let e = hadamard4(mat4x4<f32>(qs[j], qs[j + h], qs[j + 2u * h], qs[j + 3u * h]));
            qs[j] = e[0];
            qs[j + h] = e[1];
            qs[j + 2u * h] = e[2];
            qs[j + 3u * h] = e[3];
        }
    } else {
        for (var p = lid; p < DIM / 2u; p += WG) {
            let j = (p / h) * 2u * h + p % h;
            let a = qs[j];
            let b = qs[j + h];
            qs[j] = a + b;
            qs[j + h] = a - b;
        }
    }
}

// `hadamard_qs` but its last stage, whose h it returns: the caller applies that one as it
// writes the output (`rotated_back`), one barrier fewer. For D >= 8 and h0 < D; called in
// uniform control flow; ends with a barrier.
fn hadamard_qs_but_last(lid: u32, h0: u32) -> u32 {
    var h = h0;
    for (; 4u * h < DIM; h *= 4u) {
        workgroupBarrier();
        hadamard_stage(lid, h);
    }
    workgroupBarrier();
    return h;
}

// Butterflies of the last stage (`hadamard_qs_but_last`'s h): 4 members (2h < D) or 2.
fn last_radix(h: u32) -> u32 {
    return select(2u, 4u, 2u * h < DIM);
}

// Adjacent output channels after the last stage: column k of `a` is channel d + k h, of `b`
// channel d + 1 + k h (k < last_radix(h)), each a vec4 over the queries.
struct OutPairs {
    d: u32,
    a: mat4x4<f32>,
    b: mat4x4<f32>,
}

// Pair p (< h / 2) of the last stage's members j = 2p and 2p + 1: their butterflies, the
// values' signs of `stream` and the 1 / sqrt(D) — the rotation's output, ready to write.
fn rotated_back(h: u32, p: u32, stream: u32) -> OutPairs {
    let d = 2u * p;
    var a: mat4x4<f32>;
    var b: mat4x4<f32>;
    if 2u * h < DIM {
        a = hadamard4(mat4x4<f32>(qs[d], qs[d + h], qs[d + 2u * h], qs[d + 3u * h]));
        b = hadamard4(mat4x4<f32>(qs[d + 1u], qs[d + 1u + h], qs[d + 1u + 2u * h], qs[d + 1u + 3u * h]));
    } else {
        a = mat4x4<f32>(qs[d] + qs[d + h], qs[d] - qs[d + h], vec4<f32>(), vec4<f32>());
        b = mat4x4<f32>(qs[d + 1u] + qs[d + 1u + h], qs[d + 1u] - qs[d + 1u + h], vec4<f32>(), vec4<f32>());
    }
    let norm = 1.0 / sqrt(f32(DIM));
    for (var k = 0u; k < last_radix(h); k++) {
        a[k] *= sign_of(stream, d + k * h) * norm;
        b[k] *= sign_of(stream, d + 1u + k * h) * norm;
    }
    return OutPairs(d, a, b);
}

// The tile's queries into `qs` (rotated with the keys' signs of row r with ROTATE_Q).
fn load_queries(w: Work, lid: u32) {
    let q = w.q0;
    let base = vec4<u32>(query_base(w.r, q), query_base(w.r, q + 1u), query_base(w.r, q + 2u), query_base(w.r, q + 3u));
    let stream = dims.q_stream | (w.r % dims.kv_heads);
    if ROTATE_Q && DIM >= 4u {
        // 4 consecutive channels a thread: the stages of the two lowest bits in registers.
        let norm = 1.0 / sqrt(f32(DIM));
        for (var p = lid; p < DIM / 4u; p += WG) {
            var e: mat4x4<f32>;
            for (var c = 0u; c < 4u; c++) {
                let d = 4u * p + c;
                e[c] = vec4<f32>(query_at(base.x, d), query_at(base.y, d), query_at(base.z, d), query_at(base.w, d)) * (sign_of(stream, d) * norm);
            }
            e = hadamard4(e);
            for (var c = 0u; c < 4u; c++) {
                qs[4u * p + c] = e[c];
            }
        }
        hadamard_qs(lid, 4u);
        return;
    }
    for (var d = lid; d < DIM; d += WG) {
        var x = vec4<f32>(query_at(base.x, d), query_at(base.y, d), query_at(base.z, d), query_at(base.w, d));
        if ROTATE_Q {
            x *= sign_of(stream, d) / sqrt(f32(DIM));
        }
        qs[d] = x;
    }
    if ROTATE_Q {
        hadamard_qs(lid, 1u);
    }
}

// Buffers of a side: 0 = keys, 1 = values. Words at..at + 3 of its page buffer (at a
// multiple of 4).
fn meta_quad(side: u32, at: u32) -> vec4<u32> {
    if side == 0u {
        return k_meta[at / 4u];
    }
    return v_meta[at / 4u];
}

// Word `at` of a side's page buffer: one word loaded (component `at % 4` of the vector it
// lies in, addressed through the view rather than picked out of a loaded vector).
fn meta_word(side: u32, at: u32) -> u32 {
    let i = at / 4u;
    let c = at % 4u;
    if side == 0u {
        return k_meta[i][c];
    }
    return v_meta[i][c];
}

// Words at..at + 3 of a side's codes (at a multiple of 4).
fn codes_quad(side: u32, at: u32) -> vec4<u32> {
    if OWN_CODES {
        return meta_quad(side, at);
    }
    if side == 0u {
        return k_aux[at / 4u];
    }
    return v_aux[at / 4u];
}

// Word `at` of a side's codes, one word loaded (`meta_word`).
fn codes_word(side: u32, at: u32) -> u32 {
    if OWN_CODES {
        return meta_word(side, at);
    }
    let i = at / 4u;
    let c = at % 4u;
    if side == 0u {
        return k_aux[i][c];
    }
    return v_aux[i][c];
}

fn side_of(side: u32) -> Side {
    if side == 0u {
        return dims.k;
    }
    return dims.v;
}

// What a side's own codes stand for: the code itself, or a Lloyd-Max level (LEVELS).
const NUMBERS: u32 = 0u;
const K_TABLE: u32 = 1u;
const V_TABLE: u32 = 2u;

fn table_of(side: u32) -> u32 {
    if side == 0u {
        return select(NUMBERS, K_TABLE, K_LEVELS);
    }
    return select(NUMBERS, V_TABLE, V_LEVELS);
}

// Level k of a Lloyd-Max table (a uniform load: k is the same in every invocation).
fn table_level(table: u32, k: u32) -> f32 {
    if table == K_TABLE {
        return dims.k_levels[k / 4u][k % 4u];
    }
    return dims.v_levels[k / 4u][k % 4u];
}

// Code c's value in `table`.
fn level_of(table: u32, c: u32) -> f32 {
    return levels4(table, vec4<u32>(c)).x;
}

// Codes' values in `table`. Lloyd-Max levels are symmetric, L[half + k] = -L[half - 1 - k].
// Two bits, L = (-a, -b, b, a): L is affine in the code's bits, L(c) = (a + b) / 2 * c +
// (a - 3b) / 2 * (c & 1) - a, two multiply-adds. Wider: the magnitude index is k = c - half
// above the middle and half - 1 - c below it, and the magnitude is picked by comparisons
// against the upper half's levels (uniform loads), not by a per-invocation indexed load.
fn levels4(table: u32, c: vec4<u32>) -> vec4<f32> {
    if table == NUMBERS {
        return vec4<f32>(c);
    }
    let bits = select(V_BITS, K_BITS, table == K_TABLE);
    if bits == 2u {
        let a = table_level(table, 3u);
        let b = table_level(table, 2u);
        return vec4<f32>(c) * (0.5 * (a + b)) + vec4<f32>(c & vec4<u32>(1u)) * (0.5 * (a - 3.0 * b)) - a;
    }
    let half = 1u << (bits - 1u);
    let up = c >= vec4<u32>(half);
    let k = (c & vec4<u32>(half - 1u)) ^ select(vec4<u32>(half - 1u), vec4<u32>(0u), up);
    var m = vec4<f32>(table_level(table, half));
    for (var i = 1u; i < half; i++) {
        m = select(m, vec4<f32>(table_level(table, half + i)), k == vec4<u32>(i));
    }
    return select(-m, m, up);
}

// (scale, zero) of cell (r, g, o) of a side's params (`res`: the residual's); with levels
// (norm, 0): the norm at word `cell` (f32) or half o of row (r, g), rows starting words.
fn params_of(side: u32, res: bool, r: u32, g: u32, o: u32) -> vec2<f32> {
    let s = side_of(side);
    let cell = (r * s.groups + g) * s.other + o;
    if !res && table_of(side) != NUMBERS {
        if PARAMS_F32 {
            return vec2<f32>(bitcast<f32>(meta_word(side, s.params + cell)), 0.0);
        }
        let word = meta_word(side, s.params + (r * s.groups + g) * ((s.other + 1u) / 2u) + o / 2u);
        return vec2<f32>(unpack2x16float(word)[o % 2u], 0.0);
    }
    let base = select(s.params, s.res_params, res);
    if PARAMS_F32 {
        return vec2<f32>(bitcast<f32>(meta_word(side, base + 2u * cell)), bitcast<f32>(meta_word(side, base + 2u * cell + 1u)));
    }
    return unpack2x16float(meta_word(side, base + cell));
}

// The bits of members m0.. of cell (r, g, o), shifted down so member m0 is at bit 0: a group's
// codes are one little-endian bit stream of `bits`-bit codes spread over `wpg` words, word w
// at ((r * groups + g) * wpg + w) * O + o. Holds 32 bits (enough for TT codes).
fn code_window(side: u32, res: bool, r: u32, g: u32, o: u32, m0: u32, bits: u32) -> u32 {
    return code_words(side, res, r, g, o, m0, bits, 32u).x;
}

// `code_window` as 64 bits (.x the low word) of which `need` are used: the next word is read
// only if they reach into it.
fn code_words(side: u32, res: bool, r: u32, g: u32, o: u32, m0: u32, bits: u32, need: u32) -> vec2<u32> {
    return window64(side, res, windows_at(side, res, r, g, m0, bits, need), o);
}

// Whether a run's `bits`-bit codes always lie in two consecutive words: runs start at
// members that are multiples of TT, so a run starts at bit offsets that are multiples of
// gcd(TT bits, 32) within a word.
fn run_fits64(bits: u32) -> bool {
    let n = TT * bits;
    let step = min(n & (~n + 1u), 32u);
    return 32u - step + n <= 64u;
}

// The bits of the TT members m0.. of cell (r, g, o) (all of them where `run_fits64(bits)`):
// one or two word loads where code windows per 8 members would take up to four.
fn run_window(side: u32, res: bool, r: u32, g: u32, o: u32, m0: u32, bits: u32) -> vec2<u32> {
    return code_words(side, res, r, g, o, m0, bits, TT * bits);
}

// Codes of the 4 consecutive members 4 * tv .. of a run window.
fn run_codes4(win: vec2<u32>, tv: u32, bits: u32) -> vec4<f32> {
    let p = 4u * tv * bits;
    var v = win.x;
    if p >= 32u {
        v = win.y >> (p - 32u);
    } else if p > 0u {
        v = (win.x >> p) | (win.y << (32u - p));
    }
    return codes4(v, 0u, bits);
}

// Codes of the 4 consecutive members 4 * tv .. of a window.
fn codes4(window: u32, tv: u32, bits: u32) -> vec4<f32> {
    let s = vec4<u32>(window >> (4u * tv * bits));
    return vec4<f32>((s >> (vec4<u32>(0u, 1u, 2u, 3u) * bits)) & vec4<u32>((1u << bits) - 1u));
}

// Residual codes of token-vec tv of a run from member m0: from `win` (`window64` at m0)
// where the run's codes fit it or these are in its first word, else from a window loaded at
// m0 + 4 tv (a residual may be wider than the run's codes).
fn res_codes4(side: u32, r: u32, g: u32, o: u32, m0: u32, tv: u32, bits: u32, win: vec2<u32>) -> vec4<f32> {
    if run_fits64(bits) || (tv + 1u) * 4u * bits <= 32u {
        return run_codes4(win, tv, bits);
    }
    return codes4(code_window(side, true, r, g, o, m0 + 4u * tv, bits), 0u, bits);
}

fn code1(window: u32, bits: u32, table: u32) -> f32 {
    return level_of(table, window & ((1u << bits) - 1u));
}

fn prob_at(q: u32, j4: u32) -> u32 {
    return q * (CHUNK / 4u) + j4;
}

// Column q = query q's scores of 4 consecutive tokens: the outer product of 4 queries' values
// and 4 tokens' values (accumulators live in named matrices: indexed arrays of them are not
// kept in registers).
fn outer(q: vec4<f32>, k: vec4<f32>) -> mat4x4<f32> {
    var m = mat4x4<f32>();
    m[0] = q.x * k;
    if QT > 1u {
        m[1] = q.y * k;
    }
    if QT > 2u {
        m[2] = q.z * k;
    }
    if QT > 3u {
        m[3] = q.w * k;
    }
    return m;
}

fn plus_cols(m: mat4x4<f32>, b: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(m[0] + b.x, m[1] + b.y, m[2] + b.z, m[3] + b.w);
}

// Stores the scores of tokens j .. j + 3 (columns: queries; NEG where masked: later than
// the query, or out of its sliding window).
fn store4(w: Work, j: u32, m: mat4x4<f32>) {
    let jj = vec4<u32>(j) + vec4<u32>(0u, 1u, 2u, 3u);
    let pos = positions(w, vec4<u32>(w.j0) + jj);
    let beyond = jj >= vec4<u32>(w.nj);
    for (var q = 0u; q < QT; q++) {
        let qp = vec4<u32>(query_pos(w, q));
        let far = (pos + vec4<u32>(dims.window) <= qp) & vec4<bool>(dims.window > 0u);
        let masked = (pos > qp) | far | beyond;
        prob[prob_at(q, w.p0 + j / 4u)] = select(m[q], vec4<f32>(NEG), masked);
    }
}

// Stores the scores of a run of TT tokens from j (4 tokens per matrix). Segments start at
// whole runs and chunks end at them, so a run's slots are all its segment's.
fn store_run(w: Work, j: u32, m0: mat4x4<f32>, m1: mat4x4<f32>, m2: mat4x4<f32>, m3: mat4x4<f32>) {
    store4(w, j, m0);
    if TT > 4u {
        store4(w, j + 4u, m1);
    }
    if TT > 8u {
        store4(w, j + 8u, m2);
    }
    if TT > 12u {
        store4(w, j + 12u, m3);
    }
}

// Scores of TT tokens of a run, one token at a time (groups not aligned to runs of 4): key
// values dequantized as read.
fn slow_scores(w: Work, pt: u32) -> array<vec4<f32>, TT_MAX> {
    var out: array<vec4<f32>, TT_MAX>;   // [token]: the 4 queries' scores
    for (var i = 0u; i < TT; i++) {
        var score = vec4<f32>(0.0);
        for (var d = 0u; d < DIM; d++) {
            var g = (pt + i) / GROUP;
            var o = d;
            var m = (pt + i) % GROUP;
            if K_CHANNELS {
                g = d / GROUP;
                o = pt + i;
                m = d % GROUP;
            }
            let own = params_of(0u, false, w.r, g, o);
            var k = code1(code_window(0u, false, w.r, g, o, m, K_BITS), K_BITS, table_of(0u)) * own.x + own.y;
            if K_RESIDUAL {
                let res = params_of(0u, true, w.r, g, o);
                k += code1(code_window(0u, true, w.r, g, o, m, K_RES_BITS), K_RES_BITS, NUMBERS) * res.x + res.y;
            }
            score += qs[d] * k;
        }
        out[i] = score;
    }
    return out;
}

// The 4 tokens i .. i + 3 of per-token scores as a matrix (columns: queries).
fn tokens4(s: array<vec4<f32>, TT_MAX>, i: u32) -> mat4x4<f32> {
    return transpose(mat4x4<f32>(s[i], s[i + 1u], s[i + 2u], s[i + 3u]));
}

// Key phase (quantized block): scores of every token of the chunk.
fn block_scores(w: Work, lid: u32) {
    if pairs_runs(w) {
        block_pair_scores(w, lid);
        return;
    }
    let runs = (w.nj + TT - 1u) / TT;
    for (var run = first_run(w, lid); run < runs; run += WG) {
        let j = run * TT;
        let pt = w.t0 + w.j0 + j;   // page token of the run's first token
        if K_CHANNELS || GENERIC {
            let s = slow_scores(w, pt);
            store_run(w, j, tokens4(s, 0u), tokens4(s, 4u), tokens4(s, 8u), tokens4(s, 12u));
            continue;
        }
        let g = pt / GROUP;
        let m0 = pt % GROUP;
        let own_at = windows_at(0u, false, w.r, g, m0, K_BITS, TT * K_BITS);
        let res_at = windows_at(0u, true, w.r, g, m0, K_RES_BITS, TT * K_RES_BITS);
        // Channels n at a time: 4 from one load of their params and of each code word
        // (`key_quads`), else 1, each written out (`run_channel`): a loop over them carries
        // every sum through each channel, which a CPU rasterizer stores under the lanes' mask
        // (at 16K tokens the default's attention 3-4% slower so).
        var s = RunSums();
        let n = key_step();
        for (var d0 = 0u; d0 < DIM; d0 += n) {
            let own4 = key_params4(false, w.r, g, d0);
            let win4 = key_windows4(false, own_at, d0);
            var res4 = mat2x4<f32>();
            var rwin4 = Windows4();
            if K_RESIDUAL {
                res4 = key_params4(true, w.r, g, d0);
                rwin4 = key_windows4(true, res_at, d0);
            }
            s = run_channel(s, w.r, g, d0, m0, own4, win4, res4, rwin4, 0u);
            if n > 1u {
                s = run_channel(s, w.r, g, d0, m0, own4, win4, res4, rwin4, 1u);
                s = run_channel(s, w.r, g, d0, m0, own4, win4, res4, rwin4, 2u);
                s = run_channel(s, w.r, g, d0, m0, own4, win4, res4, rwin4, 3u);
            }
        }
        let b = s.bias;
        store_run(w, j, plus_cols(s.a.m0, b), plus_cols(s.a.m1, b), plus_cols(s.a.m2, b), plus_cols(s.a.m3, b));
    }
}

// A run's scores so far: its quads of tokens (column q: query q) and the zeros' terms.
struct RunSums {
    a: Mats4,
    bias: vec4<f32>,
}

// s plus channel d0 + i of a run's step (`key_step`), from the step's params and code
// windows (`key_params4`, `key_windows4`).
fn run_channel(s: RunSums, r: u32, g: u32, d0: u32, m0: u32, own4: mat2x4<f32>, win4: Windows4, res4: mat2x4<f32>, rwin4: Windows4, i: u32) -> RunSums {
    var o = s;
    let d = d0 + i;
    let q = qs[d];
    let own = lane2(own4, i);
    let win = lane_win(win4, i);
    if K_RESIDUAL {
        // Two codes per key: one outer product of the key values s c + rs rc (less the
        // zeros) instead of one per code stream.
        let res = lane2(res4, i);
        let rwin = lane_win(rwin4, i);
        o.bias += q * (own.y + res.y);
        o.a.m0 += outer(q, run_codes4(win, 0u, K_BITS) * own.x + res_codes4(0u, r, g, d, m0, 0u, K_RES_BITS, rwin) * res.x);
        if TT > 4u {
            o.a.m1 += outer(q, run_codes4(win, 1u, K_BITS) * own.x + res_codes4(0u, r, g, d, m0, 1u, K_RES_BITS, rwin) * res.x);
        }
        if TT > 8u {
            o.a.m2 += outer(q, run_codes4(win, 2u, K_BITS) * own.x + res_codes4(0u, r, g, d, m0, 2u, K_RES_BITS, rwin) * res.x);
            o.a.m3 += outer(q, run_codes4(win, 3u, K_BITS) * own.x + res_codes4(0u, r, g, d, m0, 3u, K_RES_BITS, rwin) * res.x);
        }
        return o;
    }
    let qk = q * own.x;
    o.bias += q * own.y;
    o.a.m0 += outer(qk, run_codes4(win, 0u, K_BITS));
    if TT > 4u {
        o.a.m1 += outer(qk, run_codes4(win, 1u, K_BITS));
    }
    if TT > 8u {
        o.a.m2 += outer(qk, run_codes4(win, 2u, K_BITS));
        o.a.m3 += outer(qk, run_codes4(win, 3u, K_BITS));
    }
    return o;
}

// Whether the key phase reads 4 channels' params and code words a load: keys grouped along
// tokens (a group's cells are its channels, O = D) with D a multiple of 4, so channels
// d..d + 3 (d a multiple of 4) are 4 consecutive words from a multiple of 4 in every section.
// A CPU rasterizer loads storage lane by lane: 16 bytes in one load cost what 4 do.
fn key_quads() -> bool {
    return !K_CHANNELS && !GENERIC && !K_LEVELS && DIM % 4u == 0u;
}

// The key phase's channels a step: 4 with `key_quads`, else 1.
fn key_step() -> u32 {
    return select(1u, 4u, key_quads());
}

// The params of the key phase's step from channel d in group g of row r (`res`: the
// residual's): `cell_params4`'s 4 channels with `key_quads`, else channel d's in lane 0.
fn key_params4(res: bool, r: u32, g: u32, d: u32) -> mat2x4<f32> {
    if key_quads() {
        return cell_params4(0u, res, r, g, d);
    }
    let p = params_of(0u, res, r, g, d);
    return mat2x4<f32>(vec4<f32>(p.x, 0.0, 0.0, 0.0), vec4<f32>(p.y, 0.0, 0.0, 0.0));
}

// The code windows of the key phase's step from channel d (`window64_quad`, or `window64`
// in lane 0).
fn key_windows4(res: bool, win: Windows, d: u32) -> Windows4 {
    if key_quads() {
        return window64_quad(0u, res, win, d);
    }
    let v = window64(0u, res, win, d);
    return Windows4(vec4<u32>(v.x, 0u, 0u, 0u), vec4<u32>(v.y, 0u, 0u, 0u));
}

// The code words of a pair of runs for the key phase's step from channel d (`pair_quads`,
// or `pair_words` in lane 0).
fn key_pair_words4(res: bool, win: Windows, d: u32, bits: u32) -> PairQuads {
    if key_quads() {
        return pair_quads(res, win, d, bits);
    }
    let v = pair_words(res, win, d, bits);
    return PairQuads(vec4<u32>(v.x, 0u, 0u, 0u), vec4<u32>(v.y, 0u, 0u, 0u), vec4<u32>(v.z, 0u, 0u, 0u), vec4<u32>(v.w, 0u, 0u, 0u));
}

// `key_quads` for values: values grouped along tokens (`block_sums`).
fn value_quads() -> bool {
    return !V_CHANNELS && !GENERIC && !V_LEVELS && DIM % 4u == 0u;
}

// (scales, zeros) of a side's cells d..d + 3 in group g of row r (`res`: the residual's), as
// vec4s over the cells (d a multiple of 4): channels of a side grouped along tokens
// (`key_quads`, `value_quads`), tokens of one grouped along D (`TOKEN_QUADS`, `params4`).
fn cell_params4(side: u32, res: bool, r: u32, g: u32, d: u32) -> mat2x4<f32> {
    let s = side_of(side);
    let cell = (r * s.groups + g) * s.other + d;
    let base = select(s.params, s.res_params, res);
    if PARAMS_F32 {
        let x = meta_quad(side, base + 2u * cell);
        let y = meta_quad(side, base + 2u * cell + 4u);
        return mat2x4<f32>(bitcast<vec4<f32>>(vec4<u32>(x.x, x.z, y.x, y.z)),
                           bitcast<vec4<f32>>(vec4<u32>(x.y, x.w, y.y, y.w)));
    }
    let q = meta_quad(side, base + cell);
    return halves4(q.x, q.y, q.z, q.w);
}

// Channel i's (scale, zero) of `cell_params4`.
fn lane2(p: mat2x4<f32>, i: u32) -> vec2<f32> {
    return vec2<f32>(p[0][i], p[1][i]);
}

// `window64` of a side's 4 consecutive cells o..o + 3 at `win` (o a multiple of 4): their low words
// (lo) and high words (hi) as vec4s over the cells.
struct Windows4 {
    lo: vec4<u32>,
    hi: vec4<u32>,
}

fn window64_quad(side: u32, res: bool, win: Windows, o: u32) -> Windows4 {
    let lo = window_quad(side, res, win.at + o);
    var hi = vec4<u32>(0u);
    if win.spill {
        hi = window_quad(side, res, win.at + o + win.other);
    }
    if win.off == 0u {
        return Windows4(lo, hi);
    }
    return Windows4((lo >> vec4<u32>(win.off)) | (hi << vec4<u32>(32u - win.off)), hi >> vec4<u32>(win.off));
}

// Cell i's window of `window64_quad`.
fn lane_win(v: Windows4, i: u32) -> vec2<u32> {
    return vec2<u32>(v.lo[i], v.hi[i]);
}

// Key phase over pairs of runs (`pairs_runs`): a thread scores runs 2k and 2k + 1 in one walk
// over the channels, so each channel's query, params and code words are loaded once per 32
// tokens instead of once per 16. The pair's codes start a word (32 members of `bits` bits
// from a member that is a multiple of 32) and fill `bits` words: up to 4.
fn pairs_runs(w: Work) -> bool {
    let bits_fit = K_BITS <= 4u && (!K_RESIDUAL || K_RES_BITS <= 4u);
    let aligned = GROUP % (2u * TT) == 0u && (w.t0 + w.j0) % (2u * TT) == 0u;
    return TT == 16u && !K_CHANNELS && !GENERIC && bits_fit && aligned && w.nj >= 2u * WG * 2u * TT;
}

// Words 0 .. bits - 1 of cell o's codes at `win` (`windows_at` of a word-aligned member).
fn pair_words(res: bool, win: Windows, o: u32, bits: u32) -> vec4<u32> {
    var v = vec4<u32>(window_word(0u, res, win.at + o), 0u, 0u, 0u);
    if bits > 1u {
        v.y = window_word(0u, res, win.at + o + win.other);
    }
    if bits > 2u {
        v.z = window_word(0u, res, win.at + o + 2u * win.other);
    }
    if bits > 3u {
        v.w = window_word(0u, res, win.at + o + 3u * win.other);
    }
    return v;
}

// Codes of the 4 consecutive members 4 tv .. of a pair's words (tv a constant once inlined, so
// the words' components are picked in registers).
fn pair_codes4(v: vec4<u32>, tv: u32, bits: u32) -> vec4<f32> {
    let p = 4u * tv * bits;
    let k = p / 32u;
    let off = p % 32u;
    var x = v[k] >> off;
    if off + 4u * bits > 32u {
        x |= v[k + 1u] << (32u - off);
    }
    return codes4(x, 0u, bits);
}

// Key values of members 4 tv .. of a pair: own codes times scale, plus the residual's.
fn pair_keys4(own: vec4<u32>, s: f32, res: vec4<u32>, rs: f32, tv: u32) -> vec4<f32> {
    let k = pair_codes4(own, tv, K_BITS) * s;
    if K_RESIDUAL {
        return k + pair_codes4(res, tv, K_RES_BITS) * rs;
    }
    return k;
}

// A pair's sums so far: the first run's quads (lo), the second's (hi), the zeros' terms.
struct PairSums {
    lo: Mats4,
    hi: Mats4,
    bias: vec4<f32>,
}

// s plus channel i of the step's (`key_step`) query q, params and code words: both runs
// scored whether or not the second is the segment's (its codes share the first's words;
// `block_pair_scores` stores it only if it is), so no lane branches around the sums.
fn pair_channel(s: PairSums, q0: vec4<f32>, own4: mat2x4<f32>, cw4: PairQuads, res4: mat2x4<f32>, rw4: PairQuads, i: u32) -> PairSums {
    var o = s;
    var q = q0;
    let own = lane2(own4, i);
    let cw = pair_lane(cw4, i);
    // As `block_scores`: with a residual one outer product of s c + rs rc (less the zeros) a
    // token-vec, else the scale folded into the query.
    var rw = vec4<u32>(0u);
    var rs = 0.0;
    var sc = own.x;
    if K_RESIDUAL {
        let res = lane2(res4, i);
        o.bias += q * (own.y + res.y);
        rw = pair_lane(rw4, i);
        rs = res.x;
    } else {
        o.bias += q * own.y;
        q *= own.x;
        sc = 1.0;
    }
    o.lo.m0 += outer(q, pair_keys4(cw, sc, rw, rs, 0u));
    o.lo.m1 += outer(q, pair_keys4(cw, sc, rw, rs, 1u));
    o.lo.m2 += outer(q, pair_keys4(cw, sc, rw, rs, 2u));
    o.lo.m3 += outer(q, pair_keys4(cw, sc, rw, rs, 3u));
    o.hi.m0 += outer(q, pair_keys4(cw, sc, rw, rs, 4u));
    o.hi.m1 += outer(q, pair_keys4(cw, sc, rw, rs, 5u));
    o.hi.m2 += outer(q, pair_keys4(cw, sc, rw, rs, 6u));
    o.hi.m3 += outer(q, pair_keys4(cw, sc, rw, rs, 7u));
    return o;
}

fn block_pair_scores(w: Work, lid: u32) {
    let runs = (w.nj + TT - 1u) / TT;
    let pairs = (runs + 1u) / 2u;
    for (var pair = first_run(w, lid); pair < pairs; pair += WG) {
        let j = pair * 2u * TT;
        let pt = w.t0 + w.j0 + j;
        let g = pt / GROUP;
        let m0 = pt % GROUP;
        var s = PairSums();
        let own_at = windows_at(0u, false, w.r, g, m0, K_BITS, 32u);
        let res_at = windows_at(0u, true, w.r, g, m0, K_RES_BITS, 32u);
        // As `block_scores`: the step's channels written out (`pair_channel`).
        let n = key_step();
        for (var d0 = 0u; d0 < DIM; d0 += n) {
            let own4 = key_params4(false, w.r, g, d0);
            let cw4 = key_pair_words4(false, own_at, d0, K_BITS);
            var res4 = mat2x4<f32>();
            var rw4 = PairQuads();
            if K_RESIDUAL {
                res4 = key_params4(true, w.r, g, d0);
                rw4 = key_pair_words4(true, res_at, d0, K_RES_BITS);
            }
            s = pair_channel(s, qs[d0], own4, cw4, res4, rw4, 0u);
            if n > 1u {
                s = pair_channel(s, qs[d0 + 1u], own4, cw4, res4, rw4, 1u);
                s = pair_channel(s, qs[d0 + 2u], own4, cw4, res4, rw4, 2u);
                s = pair_channel(s, qs[d0 + 3u], own4, cw4, res4, rw4, 3u);
            }
        }
        let b = s.bias;
        store_run(w, j, plus_cols(s.lo.m0, b), plus_cols(s.lo.m1, b), plus_cols(s.lo.m2, b), plus_cols(s.lo.m3, b));
        if 2u * pair + 1u < runs {
            store_run(w, j + TT, plus_cols(s.hi.m0, b), plus_cols(s.hi.m1, b), plus_cols(s.hi.m2, b), plus_cols(s.hi.m3, b));
        }
    }
}

// `pair_words` of 4 consecutive cells o..o + 3 (o a multiple of 4): word k of each in wk.
struct PairQuads {
    w0: vec4<u32>,
    w1: vec4<u32>,
    w2: vec4<u32>,
    w3: vec4<u32>,
}

fn pair_quads(res: bool, win: Windows, o: u32, bits: u32) -> PairQuads {
    var v = PairQuads();
    v.w0 = window_quad(0u, res, win.at + o);
    if bits > 1u {
        v.w1 = window_quad(0u, res, win.at + o + win.other);
    }
    if bits > 2u {
        v.w2 = window_quad(0u, res, win.at + o + 2u * win.other);
    }
    if bits > 3u {
        v.w3 = window_quad(0u, res, win.at + o + 3u * win.other);
    }
    return v;
}

// Cell i's words of `pair_quads`.
fn pair_lane(v: PairQuads, i: u32) -> vec4<u32> {
    return vec4<u32>(v.w0[i], v.w1[i], v.w2[i], v.w3[i]);
}

// The first of a segment's runs that thread `lid` scores: the chunk's runs go to the threads
// in turn across its segments, so a segment starts at the thread after the previous one's
// last run (a block and the window after it: no thread scores runs of both while another
// idles).
fn first_run(w: Work, lid: u32) -> u32 {
    let before = (4u * w.p0 / TT) % WG;
    return (lid + WG - before) % WG;
}

// Page tokens of the 4 consecutive chunk tokens from chunk token j, clamped to the chunk's
// last token (tokens past it weigh nothing and must not read past the block).
fn tokens_at(w: Work, j: u32) -> vec4<u32> {
    let first = w.t0 + w.j0;
    return min(vec4<u32>(first + j) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(first + w.nj - 1u));
}

// Where the code windows of member m0 of group g of row r start: word `at + o` holds cell
// o's bits from m0 on (from bit `off`; a cell is a token where the side is grouped along D,
// a channel where along tokens), and where the `need` bits used reach past it (`spill`),
// word `at + o + other` holds the rest. Found once per thread and walk, not per cell.
struct Windows {
    at: u32,
    off: u32,
    other: u32,
    spill: bool,
}

fn windows_at(side: u32, res: bool, r: u32, g: u32, m0: u32, bits: u32, need: u32) -> Windows {
    let s = side_of(side);
    let wpg = select(s.wpg, s.rwpg, res);
    let pos = m0 * bits;
    let off = pos % 32u;
    let at = ((r * s.groups + g) * wpg + pos / 32u) * s.other + select(s.codes, s.res_codes, res);
    return Windows(at, off, s.other, off + need > 32u && pos / 32u + 1u < wpg);
}

// The 64 bits from member m0 on of cell o at `win` (`windows_at`), .x the low word.
fn window64(side: u32, res: bool, win: Windows, o: u32) -> vec2<u32> {
    let lo = window_word(side, res, win.at + o);
    var hi = 0u;
    if win.spill {
        hi = window_word(side, res, win.at + o + win.other);
    }
    if win.off == 0u {
        return vec2<u32>(lo, hi);
    }
    return vec2<u32>((lo >> win.off) | (hi << (32u - win.off)), hi >> win.off);
}

// Word `at` of a side's codes (`res`: its residual's, in the meta buffer).
fn window_word(side: u32, res: bool, at: u32) -> u32 {
    if res {
        return meta_word(side, at);
    }
    return codes_word(side, at);
}

// Words at..at + 3 of a side's codes (`res`: its residual's; at a multiple of 4).
fn window_quad(side: u32, res: bool, at: u32) -> vec4<u32> {
    if res {
        return meta_quad(side, at);
    }
    return codes_quad(side, at);
}

// The code windows of 4 tokens (page tokens pt) at `win` (`windows_at`), shifted so member
// m0 is at bit 0 of each; with TOKEN_QUADS one load for each word (tokens pt.x .. pt.x + 3,
// as `params4`).
fn windows4(side: u32, res: bool, win: Windows, pt: vec4<u32>) -> vec4<u32> {
    let at = vec4<u32>(win.at) + pt;
    var lo: vec4<u32>;
    if TOKEN_QUADS {
        lo = window_quad(side, res, at.x);
    } else {
        lo = vec4<u32>(window_word(side, res, at.x), window_word(side, res, at.y),
                       window_word(side, res, at.z), window_word(side, res, at.w));
    }
    if win.off == 0u {
        return lo;
    }
    var hi = vec4<u32>(0u);
    if win.spill {
        let up = at + vec4<u32>(win.other);
        if TOKEN_QUADS {
            hi = window_quad(side, res, up.x);
        } else {
            hi = vec4<u32>(window_word(side, res, up.x), window_word(side, res, up.y),
                           window_word(side, res, up.z), window_word(side, res, up.w));
        }
    }
    return (lo >> vec4<u32>(win.off)) | (hi << vec4<u32>(32u - win.off));
}

// Code c of each of 4 tokens' windows, as a vec4 over the tokens, valued in `table`.
fn chan4(win: vec4<u32>, c: u32, bits: u32, table: u32) -> vec4<f32> {
    return levels4(table, (win >> vec4<u32>(c * bits)) & vec4<u32>((1u << bits) - 1u));
}

// Group g's params of 4 tokens: scales (column 0) and zeros (column 1) as vec4s over them.
// With TOKEN_QUADS, of tokens pt.x .. pt.x + 3 (the same but where `tokens_at` clamped the
// segment's last vec4: the tokens past it, in the page, weigh nothing).
fn params4(side: u32, res: bool, r: u32, g: u32, pt: vec4<u32>) -> mat2x4<f32> {
    if TOKEN_QUADS && !res && table_of(side) != NUMBERS {
        // Norms: f32 words, or f16 halves in rows of (O + 1) / 2 words (O a multiple of 4,
        // so 4 tokens' halves are the low or the high pair of a vec4).
        let s = side_of(side);
        let cell = (r * s.groups + g) * s.other + pt.x;
        if PARAMS_F32 {
            return mat2x4<f32>(bitcast<vec4<f32>>(meta_quad(side, s.params + cell)), vec4<f32>(0.0));
        }
        let at = s.params + (r * s.groups + g) * (s.other / 2u) + pt.x / 2u;
        let q = meta_quad(side, at & ~3u);
        let h = select(q.xy, q.zw, (at & 2u) != 0u);
        let a = unpack2x16float(h.x);
        let b = unpack2x16float(h.y);
        return mat2x4<f32>(vec4<f32>(a.x, a.y, b.x, b.y), vec4<f32>(0.0));
    }
    if TOKEN_QUADS {
        return cell_params4(side, res, r, g, pt.x);
    }
    let a = params_of(side, res, r, g, pt.x);
    let b = params_of(side, res, r, g, pt.y);
    let c = params_of(side, res, r, g, pt.z);
    let e = params_of(side, res, r, g, pt.w);
    return mat2x4<f32>(vec4<f32>(a.x, b.x, c.x, e.x), vec4<f32>(a.y, b.y, c.y, e.y));
}

// Key phase, keys grouped along D (per token): per 4 tokens and group, the integer codes meet
// the queries first (a = sum_d q[d] c[j, d], CK channels per code window), then the tokens'
// scales and zeros apply once per group: s[j] a + z[j] sum_d q[d].
fn token_scores(w: Work, lid: u32) {
    let runs = (w.nj + TT - 1u) / TT;
    for (var run = first_run(w, lid); run < runs; run += WG) {
        for (var tv = 0u; tv < TT / 4u; tv++) {
            let j = run * TT + 4u * tv;
            let pt = tokens_at(w, j);
            var acc = mat4x4<f32>();   // column q: query q's scores of the 4 tokens
            for (var g = 0u; g < dims.k.groups; g++) {
                var a = mat4x4<f32>();
                var ar = mat4x4<f32>();
                var qsum = vec4<f32>(0.0);
                let width = min(GROUP, DIM - g * GROUP);
                for (var m0 = 0u; m0 < width; m0 += CK) {
                    let win = windows4(0u, false, windows_at(0u, false, w.r, g, m0, K_BITS, CK * K_BITS), pt);
                    var rwin = vec4<u32>();
                    if K_RESIDUAL {
                        rwin = windows4(0u, true, windows_at(0u, true, w.r, g, m0, K_RES_BITS, CK * K_RES_BITS), pt);
                    }
                    for (var c = 0u; c < min(CK, width - m0); c++) {
                        let q = qs[g * GROUP + m0 + c];
                        qsum += q;
                        a += outer(q, chan4(win, c, K_BITS, table_of(0u)));
                        if K_RESIDUAL {
                            ar += outer(q, chan4(rwin, c, K_RES_BITS, NUMBERS));
                        }
                    }
                }
                acc += group_terms(a, qsum, w.r, g, pt);
                if K_RESIDUAL {
                    let res = params4(0u, true, w.r, g, pt);
                    acc += scale_cols(ar, res[0]) + outer(qsum, res[1]);
                }
            }
            store4(w, j, acc);
        }
    }
}

// Key phase, keys grouped along D without a residual, TT = 16 (`attend_block_runs`): as
// `token_scores`, but a thread takes its run's four quads side by side, so each query vec4 and
// each group's sum of queries serve 16 tokens instead of 4. The quads are spelled out (m0..m3):
// a CPU rasterizer keeps an array indexed in a loop in memory. Its own entry point, so the
// pipelines of other runs (TT 4 or 8, residual keys) do not carry it.
fn token_run_scores(w: Work, lid: u32) {
    let runs = (w.nj + TT - 1u) / TT;
    let table = table_of(0u);
    for (var run = first_run(w, lid); run < runs; run += WG) {
        let j = run * TT;
        let pt0 = tokens_at(w, j);
        let pt1 = tokens_at(w, j + 4u);
        let pt2 = tokens_at(w, j + 8u);
        let pt3 = tokens_at(w, j + 12u);
        var acc: Mats4;   // quad k's scores in m<k>: column q, query q's of its 4 tokens
        for (var g = 0u; g < dims.k.groups; g++) {
            var a: Mats4;
            var qsum = vec4<f32>(0.0);
            let width = min(GROUP, DIM - g * GROUP);
            for (var m0 = 0u; m0 < width; m0 += CK) {
                let at = windows_at(0u, false, w.r, g, m0, K_BITS, CK * K_BITS);
                let win0 = windows4(0u, false, at, pt0);
                let win1 = windows4(0u, false, at, pt1);
                let win2 = windows4(0u, false, at, pt2);
                let win3 = windows4(0u, false, at, pt3);
                for (var c = 0u; c < min(CK, width - m0); c++) {
                    let q = qs[g * GROUP + m0 + c];
                    qsum += q;
                    a.m0 += outer(q, chan4(win0, c, K_BITS, table));
                    a.m1 += outer(q, chan4(win1, c, K_BITS, table));
                    a.m2 += outer(q, chan4(win2, c, K_BITS, table));
                    a.m3 += outer(q, chan4(win3, c, K_BITS, table));
                }
            }
            acc.m0 += group_terms(a.m0, qsum, w.r, g, pt0);
            acc.m1 += group_terms(a.m1, qsum, w.r, g, pt1);
            acc.m2 += group_terms(a.m2, qsum, w.r, g, pt2);
            acc.m3 += group_terms(a.m3, qsum, w.r, g, pt3);
        }
        store4(w, j, acc.m0);
        store4(w, j + 4u, acc.m1);
        store4(w, j + 8u, acc.m2);
        store4(w, j + 12u, acc.m3);
    }
}

// A quad's terms of group g (tokens pt) of keys grouped along D: its codes' sums `a` times
// each token's scale, plus its zeros times the queries' sum over the group.
fn group_terms(a: mat4x4<f32>, qsum: vec4<f32>, r: u32, g: u32, pt: vec4<u32>) -> mat4x4<f32> {
    let own = params4(0u, false, r, g, pt);
    return scale_cols(a, own[0]) + outer(qsum, own[1]);
}

// The first word of the segment's tokens v .. v + 3 (counted in the segment) in row r of the
// ring buffers: the first `lead` are sinks ([R, sink_tokens, D_even / 2] from sink_word), the
// others the window's ([R, ring_tokens, D_even / 2], ring token t in slot t % ring_tokens).
// `ring_t0` is already a slot and the window holds at most ring_tokens tokens, so a slot
// past the row's end wraps with one subtraction: no remainder, which a CPU rasterizer
// computes as a scalar division per lane (clamped: tokens past the segment's weigh nothing
// but must stay in the row).
fn ring_bases(w: Work, v: u32) -> vec4<u32> {
    let half_dim = (DIM + 1u) / 2u;
    let vv = vec4<u32>(v) + vec4<u32>(0u, 1u, 2u, 3u);
    let lead = vec4<u32>(w.lead);
    let size = vec4<u32>(dims.ring_tokens);
    let x = vec4<u32>(w.t0) + vv - lead;
    let slot = min(select(x, x - size, x >= size), size - vec4<u32>(1u));
    let ring = (vec4<u32>(w.r * dims.ring_tokens) + slot) * half_dim;
    let sink = vec4<u32>(dims.sink_word) + (vec4<u32>(w.r * dims.sink_tokens) + vv) * half_dim;
    return select(ring, sink, vv < lead);
}

// The 4 words from word `at` of a side's ring (`at` a multiple of 4).
fn ring_vec(side: u32, at: u32) -> vec4<u32> {
    if side == 0u {
        return k_ring[at / 4u];
    }
    return v_ring[at / 4u];
}

// Word `at` of a side's ring.
fn ring_word(side: u32, at: u32) -> u32 {
    let i = at / 4u;
    let c = at % 4u;
    if side == 0u {
        return k_ring[i][c];
    }
    return v_ring[i][c];
}

// A word of each of 4 tokens (or cells), as their halves (even, odd) over them.
fn halves4(a: u32, b: u32, c: u32, e: u32) -> mat2x4<f32> {
    let x = unpack2x16float(a);
    let y = unpack2x16float(b);
    let z = unpack2x16float(c);
    let u = unpack2x16float(e);
    return mat2x4<f32>(vec4<f32>(x.x, y.x, z.x, u.x), vec4<f32>(x.y, y.y, z.y, u.y));
}

// The halves 2dw, 2dw + 1 of the 4 tokens at `bases` (`ring_bases`), as (even, odd) vec4s.
fn ring4(side: u32, bases: vec4<u32>, dw: u32) -> mat2x4<f32> {
    let at = bases + vec4<u32>(dw);
    return halves4(ring_word(side, at.x), ring_word(side, at.y), ring_word(side, at.z), ring_word(side, at.w));
}

// Words dw .. dw + 3 (channels 2dw .. 2dw + 7) of 4 tokens, one vec4 load a token: a word's
// halves per matrix (`ring4`'s), w0 word dw.
struct RingQuads {
    w0: mat2x4<f32>,
    w1: mat2x4<f32>,
    w2: mat2x4<f32>,
    w3: mat2x4<f32>,
}

// Whether a ring row's words dw .. dw + 3 (dw a multiple of 4) are one vec4: D a multiple of 8.
fn quads() -> bool {
    return DIM % 8u == 0u;
}

// `ring4` of words dw .. dw + 3 at once (dw a multiple of 4, `quads()`): a CPU rasterizer
// loads storage lane by lane, so a token's 16 bytes in one load cost what one word does.
fn ring_quads(side: u32, bases: vec4<u32>, dw: u32) -> RingQuads {
    let a = ring_vec(side, bases.x + dw);
    let b = ring_vec(side, bases.y + dw);
    let c = ring_vec(side, bases.z + dw);
    let e = ring_vec(side, bases.w + dw);
    return RingQuads(halves4(a.x, b.x, c.x, e.x), halves4(a.y, b.y, c.y, e.y),
                     halves4(a.z, b.z, c.z, e.z), halves4(a.w, b.w, c.w, e.w));
}

// Words dw, dw + 1 of 4 tokens (dw even) where D is a multiple of 4: a row's even word and
// the next are a half of one vec4, so one load a token (`ring4` of both, w0 word dw).
struct RingPair {
    w0: mat2x4<f32>,
    w1: mat2x4<f32>,
}

fn ring_pair(side: u32, bases: vec4<u32>, dw: u32) -> RingPair {
    let at = bases + vec4<u32>(dw);
    let a = ring_half(side, at.x);
    let b = ring_half(side, at.y);
    let c = ring_half(side, at.z);
    let e = ring_half(side, at.w);
    return RingPair(halves4(a.x, b.x, c.x, e.x), halves4(a.y, b.y, c.y, e.y));
}

// Words at, at + 1 of a side's ring (at even).
fn ring_half(side: u32, at: u32) -> vec2<u32> {
    let v = ring_vec(side, at & ~3u);
    return select(v.xy, v.zw, (at & 2u) != 0u);
}

// a plus the queries' products with words dw .. dw + 3 of 4 tokens (k, `ring_quads`), a
// word's two channels at a time, in `ring_scores`' order.
fn score_quads(a: mat4x4<f32>, k: RingQuads, dw: u32) -> mat4x4<f32> {
    let d = 2u * dw;
    var o = a;
    o += outer(qs[d], k.w0[0]) + outer(qs[d + 1u], k.w0[1]);
    o += outer(qs[d + 2u], k.w1[0]) + outer(qs[d + 3u], k.w1[1]);
    o += outer(qs[d + 4u], k.w2[0]) + outer(qs[d + 5u], k.w2[1]);
    o += outer(qs[d + 6u], k.w3[0]) + outer(qs[d + 7u], k.w3[1]);
    return o;
}

// Key phase (ring): scores of every token of the chunk from f16 words, runs of TT tokens.
fn ring_scores(w: Work, lid: u32) {
    let runs = (w.nj + TT - 1u) / TT;
    let half_dim = (DIM + 1u) / 2u;
    for (var run = first_run(w, lid); run < runs; run += WG) {
        let j = run * TT;
        let v = w.j0 + j;
        // A run's last vec4s past the segment's tokens are not read (store4 masks them).
        let left = w.nj - j;
        let b0 = ring_bases(w, v);
        let b1 = ring_bases(w, v + 4u);
        let b2 = ring_bases(w, v + 8u);
        let b3 = ring_bases(w, v + 12u);
        var a0 = mat4x4<f32>();
        var a1 = mat4x4<f32>();
        var a2 = mat4x4<f32>();
        var a3 = mat4x4<f32>();
        for (var dw = 0u; dw < half_dim && quads(); dw += 4u) {
            a0 = score_quads(a0, ring_quads(0u, b0, dw), dw);
            if TT > 4u && left > 4u {
                a1 = score_quads(a1, ring_quads(0u, b1, dw), dw);
            }
            if TT > 8u && left > 8u {
                a2 = score_quads(a2, ring_quads(0u, b2, dw), dw);
                a3 = score_quads(a3, ring_quads(0u, b3, dw), dw);
            }
        }
        for (var dw = 0u; dw < half_dim && !quads(); dw++) {
            let q0 = qs[2u * dw];
            var q1 = vec4<f32>(0.0);
            if 2u * dw + 1u < DIM {
                q1 = qs[2u * dw + 1u];
            }
            let k0 = ring4(0u, b0, dw);
            a0 += outer(q0, k0[0]) + outer(q1, k0[1]);
            if TT > 4u && left > 4u {
                let k1 = ring4(0u, b1, dw);
                a1 += outer(q0, k1[0]) + outer(q1, k1[1]);
            }
            if TT > 8u && left > 8u {
                let k2 = ring4(0u, b2, dw);
                a2 += outer(q0, k2[0]) + outer(q1, k2[1]);
                let k3 = ring4(0u, b3, dw);
                a3 += outer(q0, k3[0]) + outer(q1, k3[1]);
            }
        }
        store_run(w, j, a0, a1, a2, a3);
    }
}

fn partial(i: u32) -> f32 {
    return bitcast<f32>(partials[i]);
}

fn partial_at(r: u32, qi: u32, slot: u32) -> u32 {
    return ((r * dims.q_per_row + qi) * dims.slots + slot) * (DIM + 2u);
}

// Softmax phase over the whole workgroup: per query, the chunk's max m (each thread's max
// over its token vecs, then over the threads' in `stat`), probabilities exp(s - m) in place
// and their sum l (likewise); writes m and l to the partials (DIRECT: to stat[0] and
// stat[1]). With `folds_norms`, the probabilities of the block segment `b` leave times
// their tokens' norms (l sums them before). Called in uniform control flow; the caller's
// barrier publishes the probabilities.
fn softmax_partial(w: Work, b: Work, lid: u32) {
    let vecs = w.vn / 4u;
    var mx = vec4<f32>(NEG);   // per query
    for (var j4 = lid; j4 < vecs; j4 += WG) {
        for (var q = 0u; q < QT; q++) {
            let s = prob[prob_at(q, j4)];
            mx[q] = max(mx[q], max(max(s.x, s.y), max(s.z, s.w)));
        }
    }
    stat[lid] = mx;
    workgroupBarrier();
    var m = vec4<f32>(NEG);
    for (var t = 0u; t < WG; t++) {
        m = max(m, stat[t]);
    }
    let fold_hi = b.p0 + (b.nj + 3u) / 4u;
    var l = vec4<f32>(0.0);
    for (var j4 = lid; j4 < vecs; j4 += WG) {
        var n = vec4<f32>(1.0);
        if folds_norms() && j4 >= b.p0 && j4 < fold_hi {
            n = params4(1u, false, b.r, 0u, tokens_at(b, 4u * (j4 - b.p0)))[0];
        }
        for (var q = 0u; q < QT; q++) {
            let s = prob[prob_at(q, j4)];
            let p = select(vec4<f32>(0.0), exp(s - vec4<f32>(m[q])), (s > vec4<f32>(NEG)) & vec4<bool>(m[q] > NEG));
            prob[prob_at(q, j4)] = p * n;
            l[q] += hsum(p);
        }
    }
    stat[WG + lid] = l;
    workgroupBarrier();
    var sum = vec4<f32>(0.0);
    for (var t = 0u; t < WG; t++) {
        sum += stat[WG + t];
    }
    if DIRECT {
        if lid == 0u {
            stat[0] = m;   // no thread reads the threads' maxima any more
            stat[1] = sum; // nor thread 1's (WG > 1) or its own sum (WG = 1, read above)
        }
    } else {
        for (var q = lid; q < w.nq; q += WG) {
            let at = partial_at(w.r, w.q0 + q, dims.slot0 + w.chunk);
            partials[at + DIM] = bitcast<u32>(m[q]);
            partials[at + DIM + 1u] = bitcast<u32>(sum[q]);
        }
    }
}

// Element index in the output of channel 0 of query qi of row r.
fn out_index(r: u32, qi: u32) -> u32 {
    let gqa = dims.q_heads / dims.kv_heads;
    let b = r / dims.kv_heads;
    let h = (r % dims.kv_heads) * gqa + qi / dims.q_tokens;
    return b * dims.out_batch + h * dims.out_head + (qi % dims.q_tokens) * dims.out_token;
}

// Writes a value-phase thread's sums for channels d0 .. d0 + 3 (each a vec4 over queries):
// into the partials, or (DIRECT) normalised into the output.
fn store_values(w: Work, d0: u32, acc: mat4x4<f32>) {
    if DIRECT && ROTATE_OUT {
        // Normalised into `qs` (the queries are no longer read) with the stages of the two
        // lowest bits applied (the thread holds those 4 channels of a power-of-two D >= 4);
        // `finish` applies the others and the signs.
        let l = stat[1];
        let inv = select(vec4<f32>(0.0), 1.0 / l, l > vec4<f32>(0.0));
        if DIM < 4u {
            for (var c = 0u; c < DIM; c++) {
                qs[d0 + c] = acc[c] * inv;
            }
            return;
        }
        let e = hadamard4(acc);
        for (var c = 0u; c < 4u; c++) {
            qs[d0 + c] = e[c] * inv;
        }
        return;
    }
    if DIRECT {
        for (var q = 0u; q < QT; q++) {
            if q < w.nq {
                let l = stat[1][q];
                let inv = select(0.0, 1.0 / l, l > 0.0);
                let o = out_index(w.r, w.q0 + q) + d0;
                if OUT_F16 {
                    // D is even and d0 a multiple of 4: whole words.
                    for (var c = 0u; c < 4u; c += 2u) {
                        if d0 + c < DIM {
                            partials[o / 2u + c / 2u] = pack2x16float(vec2<f32>(acc[c][q], acc[c + 1u][q]) * inv);
                        }
                    }
                } else {
                    for (var c = 0u; c < 4u; c++) {
                        if d0 + c < DIM {
                            partials[o + c] = bitcast<u32>(acc[c][q] * inv);
                        }
                    }
                }
            }
        }
        return;
    }
    for (var q = 0u; q < QT; q++) {
        if q < w.nq {
            let at = partial_at(w.r, w.q0 + q, dims.slot0 + w.chunk);
            for (var c = 0u; c < 4u; c++) {
                if d0 + c < DIM {
                    partials[at + d0 + c] = bitcast<u32>(acc[c][q]);
                }
            }
        }
    }
}

// A chunk no query of the tile sees: an empty partial (l = 0 is skipped by combine).
fn write_empty(w: Work, lid: u32) {
    for (var q = lid; q < w.nq; q += WG) {
        let at = partial_at(w.r, w.q0 + q, dims.slot0 + w.chunk);
        partials[at + DIM] = bitcast<u32>(NEG);
        partials[at + DIM + 1u] = 0u;
    }
}

fn hsum(v: vec4<f32>) -> f32 {
    return v.x + v.y + v.z + v.w;
}

// Per column (query), the sum of its 4 tokens.
fn col_sums(m: mat4x4<f32>) -> vec4<f32> {
    return vec4<f32>(hsum(m[0]), hsum(m[1]), hsum(m[2]), hsum(m[3]));
}

// The probabilities of the segment's tokens 4 * j4 .. + 3 in this chunk (columns: queries;
// zero past QT).
fn prob4(w: Work, seg_j4: u32) -> mat4x4<f32> {
    let j4 = w.p0 + seg_j4;
    var p = mat4x4<f32>();
    p[0] = prob[prob_at(0u, j4)];
    if QT > 1u {
        p[1] = prob[prob_at(1u, j4)];
    }
    if QT > 2u {
        p[2] = prob[prob_at(2u, j4)];
    }
    if QT > 3u {
        p[3] = prob[prob_at(3u, j4)];
    }
    return p;
}

// Every column of p times x, componentwise.
fn scale_cols(p: mat4x4<f32>, x: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(p[0] * x, p[1] * x, p[2] * x, p[3] * x);
}

// Value of channel d of page token pt, dequantized as read (groups not aligned to runs of 4).
fn slow_value(w: Work, pt: u32, d: u32) -> f32 {
    var g = pt / GROUP;
    var o = d;
    var m = pt % GROUP;
    if V_CHANNELS {
        g = d / GROUP;
        o = pt;
        m = d % GROUP;
    }
    let own = params_of(1u, false, w.r, g, o);
    var x = code1(code_window(1u, false, w.r, g, o, m, V_BITS), V_BITS, table_of(1u)) * own.x + own.y;
    if V_RESIDUAL {
        let res = params_of(1u, true, w.r, g, o);
        x += code1(code_window(1u, true, w.r, g, o, m, V_RES_BITS), V_RES_BITS, NUMBERS) * res.x + res.y;
    }
    return x;
}

// A tokens-grouped value group's contribution to a channel, per query, from its own (s, z)
// and the residual's zero rz: s * sum p c + z * sum p; with a residual, `a` already holds
// sum p (s c + rs rc) and the zeros add (z + rz) * sum p.
fn group_sum(own: vec2<f32>, res_zero: f32, a: mat4x4<f32>, sp: vec4<f32>) -> vec4<f32> {
    if V_RESIDUAL {
        return col_sums(a) + (own.y + res_zero) * sp;
    }
    return own.x * col_sums(a) + own.y * sp;
}

// The scales of channels d of group g: own (column 0) and the residual's (column 1).
fn value_scales(w: Work, g: u32, d: vec4<u32>) -> mat2x4<f32> {
    if value_quads() {
        return mat2x4<f32>(cell_params4(1u, false, w.r, g, d.x)[0], cell_params4(1u, true, w.r, g, d.x)[0]);
    }
    // A channel a pass, one copy of the reads for the driver to unroll.
    var v = mat2x4<f32>();
    for (var i = 0u; i < 4u; i++) {
        v[0][i] = params_of(1u, false, w.r, g, d[i]).x;
        v[1][i] = params_of(1u, true, w.r, g, d[i]).x;
    }
    return v;
}

// The (scale, zero) of channels d (own, then the residual's zero in res) in group g: 4
// channels' at once with `value_quads` (d.x a multiple of 4).
struct ValueParams4 {
    own: mat2x4<f32>,
    res_zero: vec4<f32>,
}

fn value_params4(w: Work, g: u32, d: vec4<u32>) -> ValueParams4 {
    var v = ValueParams4();
    if value_quads() {
        v.own = cell_params4(1u, false, w.r, g, d.x);
        if V_RESIDUAL {
            v.res_zero = cell_params4(1u, true, w.r, g, d.x)[1];
        }
        return v;
    }
    for (var i = 0u; i < 4u; i++) {
        let a = params_of(1u, false, w.r, g, d[i]);
        v.own[0][i] = a.x;
        v.own[1][i] = a.y;
        if V_RESIDUAL {
            v.res_zero[i] = params_of(1u, true, w.r, g, d[i]).y;
        }
    }
    return v;
}

// The 4 group sums of channels d (`group_sum` each) from their params.
fn group_sums4(v: ValueParams4, m: Mats4, sp: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(group_sum(lane2(v.own, 0u), v.res_zero.x, m.m0, sp), group_sum(lane2(v.own, 1u), v.res_zero.y, m.m1, sp),
                       group_sum(lane2(v.own, 2u), v.res_zero.z, m.m2, sp), group_sum(lane2(v.own, 3u), v.res_zero.w, m.m3, sp));
}

// Channels d's code windows of members m.. of group g (`code_window` each; `run_window` of
// the residual's with `res`, .lo and .hi), 4 cells a load with `value_quads`.
fn value_windows4(w: Work, res: bool, g: u32, d: vec4<u32>, m: u32) -> Windows4 {
    let bits = select(V_BITS, V_RES_BITS, res);
    let need = select(32u, TT * V_RES_BITS, res);
    let win = windows_at(1u, res, w.r, g, m, bits, need);
    if value_quads() {
        return window64_quad(1u, res, win, d.x);
    }
    var v = Windows4();
    for (var i = 0u; i < 4u; i++) {
        let c = window64(1u, res, win, d[i]);
        v.lo[i] = c.x;
        v.hi[i] = c.y;
    }
    return v;
}

// Value phase (quantized block): per block of 4 channels, the probability-weighted values
// (the block's, then the ring's); with RC = 8 a thread takes two adjacent blocks, which read
// the ring's tokens and the block's probabilities once.
fn block_values(w: Work, lid: u32) {
    // Blocks of 8 channels (RC 8) or 4. A CPU adapter's narrow workgroup sums a block of 8 in
    // one walk over its tokens (each token's probabilities read once for both halves, where
    // it was measured); a GPU's wide one in two walks of four accumulators. With SPLIT_BLOCK
    // (RC 4) a block's runs and ring tokens are dealt to RP threads in turn, thread lid taking
    // block lid % blocks, phase lid / blocks, and `merge_phases` adds their sums. `block_sums`
    // and `ring_sums` are called once each (every call is compiled into the pipeline).
    let split = SPLIT_BLOCK && RP > 1u && RC == 4u && !V_CHANNELS && !GENERIC;
    let per = select(4u, 8u, RC == 8u);
    let blocks = select((DIM + 3u) / 4u, DIM / 8u, RC == 8u);
    let walks = select(1u, 2u, RC == 8u && WG > 8u);
    let phases = select(1u, RP, split);
    let first = select(lid, lid % blocks, split);
    let ph = select(0u, lid / blocks, split);
    var acc = mat4x4<f32>();
    for (var cb = first; cb < blocks; cb += WG) {
        let d0 = per * cb;
        var b = Sums8();
        var r = Sums8();
        if ph < phases {
            for (var k = 0u; k < walks; k++) {
                let s = block_sums(w, d0 + 4u * k, RC == 8u && WG <= 8u, ph, phases);
                if k == 0u {
                    b = s;
                } else {
                    b.hi = s.lo;
                }
            }
            r = ring_sums(w, d0, ph, phases, RC == 8u);
        }
        if split {
            acc = b.lo + r.lo;
            break;
        }
        store_values(w, d0, b.lo + r.lo);
        if RC == 8u {
            store_values(w, d0 + 4u, b.hi + r.hi);
        }
    }
    if split {
        merge_phases(w, first, ph, blocks, phases, acc);
    }
}

// The phases of a value phase split over threads (`ring_values`, `block_values`): thread
// (block cb, phase ph) holds `acc` for channels 4 cb .. 4 cb + 3; the phases past the first
// leave theirs in `prob` once every thread is done reading it, and the first adds them up and
// writes. Called in uniform control flow.
fn merge_phases(w: Work, cb: u32, ph: u32, blocks: u32, phases: u32, acc: mat4x4<f32>) {
    workgroupBarrier();
    if ph > 0u && ph < phases {
        put_mat(4u * ((ph - 1u) * blocks + cb), acc);
    }
    workgroupBarrier();
    if ph == 0u {
        var sum = acc;
        for (var k = 1u; k < phases; k++) {
            sum += get_mat(4u * ((k - 1u) * blocks + cb));
        }
        store_values(w, 4u * cb, sum);
    }
}

// The quantized block's probability-weighted values of channels d0 .. d0 + 3 (`lo`, column
// c: channel d0 + c, per query; with `wide` also d0 + 4 .. d0 + 7, `hi`): the two blocks of a
// wide thread read each token's probabilities once. Over the block's runs first, first +
// step, ... (values grouped along tokens; the other layouts take every token: first 0, step 1).
fn block_sums(w: Work, d0: u32, wide: bool, first: u32, step: u32) -> Sums8 {
    let runs = (w.nj + TT - 1u) / TT;
    let d = min(vec4<u32>(d0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(DIM - 1u));
    let e = min(d + vec4<u32>(4u), vec4<u32>(DIM - 1u));
    var acc = Sums8();
    if V_CHANNELS || GENERIC {
        for (var j = 0u; j < w.nj; j++) {
            let pt = w.t0 + w.j0 + j;
            let p = transpose(prob4(w, j / 4u))[j % 4u];
            acc.lo += outer(vec4<f32>(slow_value(w, pt, d.x), slow_value(w, pt, d.y), slow_value(w, pt, d.z), slow_value(w, pt, d.w)), p);
            if wide {
                acc.hi += outer(vec4<f32>(slow_value(w, pt, e.x), slow_value(w, pt, e.y), slow_value(w, pt, e.z), slow_value(w, pt, e.w)), p);
            }
        }
        return acc;
    }
    // Per group: a = sum_j p[j] c[j, d] (4 tokens per row), ps = sum_j p[j]; flushed as
    // s * a + z * ps. With a residual the codes are weighted as values,
    // a = sum_j p[j] (s c + rs rc)[j, d] (one product per token instead of two), and the
    // flush adds (z + rz) * ps.
    // Channel d0 + c in lo.m<c>, d0 + 4 + c in hi.m<c> (column q: query q).
    var lo: Mats4;
    var hi: Mats4;
    var ps = mat4x4<f32>();
    // The group of the first run (of the last one for a thread with none: it flushes nothing).
    var g_cur = (w.t0 + w.j0 + min(first, runs - 1u) * TT) / GROUP;
    var sc = mat2x4<f32>();
    var sh = mat2x4<f32>();
    if V_RESIDUAL {
        sc = value_scales(w, g_cur, d);
        if wide {
            sh = value_scales(w, g_cur, e);
        }
    }
    for (var run = first; run < runs + step; run += step) {
        let last = run >= runs;
        let j = run * TT;
        let pt = w.t0 + w.j0 + j;
        let g = pt / GROUP;
        if last || g != g_cur {
            let sp = col_sums(ps);
            acc.lo += group_sums4(value_params4(w, g_cur, d), lo, sp);
            if wide {
                acc.hi += group_sums4(value_params4(w, g_cur, e), hi, sp);
            }
            lo = Mats4();
            hi = Mats4();
            ps = mat4x4<f32>();
            g_cur = g;
            if V_RESIDUAL && !last {
                sc = value_scales(w, g, d);
                if wide {
                    sh = value_scales(w, g, e);
                }
            }
        }
        if last {
            break;
        }
        let m = pt % GROUP;
        let c = value_windows4(w, false, g, d, m).lo;
        let w0 = c.x;
        let w1 = c.y;
        let w2 = c.z;
        let w3 = c.w;
        var c2 = vec4<u32>();
        if wide {
            c2 = value_windows4(w, false, g, e, m).lo;
        }
        let w4 = c2.x;
        let w5 = c2.y;
        let w6 = c2.z;
        let w7 = c2.w;
        if V_RESIDUAL {
            let rl = value_windows4(w, true, g, d, m);
            var rh = Windows4();
            if wide {
                rh = value_windows4(w, true, g, e, m);
            }
            let r0 = lane_win(rl, 0u);
            let r1 = lane_win(rl, 1u);
            let r2 = lane_win(rl, 2u);
            let r3 = lane_win(rl, 3u);
            let r4 = lane_win(rh, 0u);
            let r5 = lane_win(rh, 1u);
            let r6 = lane_win(rh, 2u);
            let r7 = lane_win(rh, 3u);
            for (var tv = 0u; tv < TT / 4u; tv++) {
                let p = prob4(w, j / 4u + tv);
                ps += p;
                lo.m0 += scale_cols(p, codes4(w0, tv, V_BITS) * sc[0].x + res_codes4(1u, w.r, g, d.x, m, tv, V_RES_BITS, r0) * sc[1].x);
                lo.m1 += scale_cols(p, codes4(w1, tv, V_BITS) * sc[0].y + res_codes4(1u, w.r, g, d.y, m, tv, V_RES_BITS, r1) * sc[1].y);
                lo.m2 += scale_cols(p, codes4(w2, tv, V_BITS) * sc[0].z + res_codes4(1u, w.r, g, d.z, m, tv, V_RES_BITS, r2) * sc[1].z);
                lo.m3 += scale_cols(p, codes4(w3, tv, V_BITS) * sc[0].w + res_codes4(1u, w.r, g, d.w, m, tv, V_RES_BITS, r3) * sc[1].w);
                if wide {
                    hi.m0 += scale_cols(p, codes4(w4, tv, V_BITS) * sh[0].x + res_codes4(1u, w.r, g, e.x, m, tv, V_RES_BITS, r4) * sh[1].x);
                    hi.m1 += scale_cols(p, codes4(w5, tv, V_BITS) * sh[0].y + res_codes4(1u, w.r, g, e.y, m, tv, V_RES_BITS, r5) * sh[1].y);
                    hi.m2 += scale_cols(p, codes4(w6, tv, V_BITS) * sh[0].z + res_codes4(1u, w.r, g, e.z, m, tv, V_RES_BITS, r6) * sh[1].z);
                    hi.m3 += scale_cols(p, codes4(w7, tv, V_BITS) * sh[0].w + res_codes4(1u, w.r, g, e.w, m, tv, V_RES_BITS, r7) * sh[1].w);
                }
            }
            continue;
        }
        for (var tv = 0u; tv < TT / 4u; tv++) {
            let p = prob4(w, j / 4u + tv);
            ps += p;
            lo.m0 += scale_cols(p, codes4(w0, tv, V_BITS));
            lo.m1 += scale_cols(p, codes4(w1, tv, V_BITS));
            lo.m2 += scale_cols(p, codes4(w2, tv, V_BITS));
            lo.m3 += scale_cols(p, codes4(w3, tv, V_BITS));
            if wide {
                hi.m0 += scale_cols(p, codes4(w4, tv, V_BITS));
                hi.m1 += scale_cols(p, codes4(w5, tv, V_BITS));
                hi.m2 += scale_cols(p, codes4(w6, tv, V_BITS));
                hi.m3 += scale_cols(p, codes4(w7, tv, V_BITS));
            }
        }
    }
    return acc;
}

// a plus, per column c, 4 tokens' code c0 + c weighted per query by ps (column q: query q's
// probabilities of the tokens times the tokens' scales): column c is channel c0 + c.
fn weigh4(a: mat4x4<f32>, win: vec4<u32>, c0: u32, bits: u32, t: u32, ps: mat4x4<f32>) -> mat4x4<f32> {
    return a + mat4x4<f32>(chan4(win, c0, bits, t) * ps, chan4(win, c0 + 1u, bits, t) * ps,
                           chan4(win, c0 + 2u, bits, t) * ps, chan4(win, c0 + 3u, bits, t) * ps);
}

// Four mat4x4 accumulators, by name (an array of matrices would not stay in registers): a
// value-phase thread's CV channels of one group, 4 channels per matrix (`token_sums`), or
// 4 channels' per-token terms, a channel per matrix (`ring_block`).
struct Mats4 {
    m0: mat4x4<f32>,
    m1: mat4x4<f32>,
    m2: mat4x4<f32>,
    m3: mat4x4<f32>,
}

// a plus one code stream (own or residual) of 4 tokens for the thread's CV channels: win holds
// the tokens' code windows, ps the queries' probabilities times the stream's scales.
fn weigh_codes(a: Mats4, win: vec4<u32>, bits: u32, t: u32, ps: mat4x4<f32>) -> Mats4 {
    var o = a;
    o.m0 = weigh4(o.m0, win, 0u, bits, t, ps);
    if CV > 4u {
        o.m1 = weigh4(o.m1, win, 4u, bits, t, ps);
    }
    if CV > 8u {
        o.m2 = weigh4(o.m2, win, 8u, bits, t, ps);
        o.m3 = weigh4(o.m3, win, 12u, bits, t, ps);
    }
    return o;
}

// Every column of m plus b.
fn add_cols(m: mat4x4<f32>, b: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(m[0] + b, m[1] + b, m[2] + b, m[3] + b);
}

// Values grouped per token in one group a token, with Lloyd-Max levels (a norm, no zero) and
// no residual: each token's norm folds into its probabilities once, as `softmax_partial`
// writes them, for every value-phase thread, instead of each thread loading every token's
// norm.
fn folds_norms() -> bool {
    return V_CHANNELS && V_LEVELS && !V_RESIDUAL && !GENERIC && GROUP >= DIM;
}

// A value-phase thread's sums over its tokens, values grouped along D: `a` its CV channels'
// probability-weighted codes times scales (column q: query q), `bias` the zeros' terms
// (sum p z), one for all its channels.
struct TokenSums {
    a: Mats4,
    bias: vec4<f32>,
}

// Value phase, values grouped along D (per token): a thread owns CV channels of one group and
// per 4 tokens reads each token's code window once; the tokens' scales fold into their
// probabilities (ps = p s; already folded with `folds_norms`) and their zeros into the
// group's bias (sum_j p z), so a channel costs one vec4-by-matrix product per 4 tokens. The
// sums of channels d0 .. d0 + CV - 1 over the segment's token vecs first, first + step, ...
fn token_sums(w: Work, d0: u32, first: u32, step: u32) -> TokenSums {
    let g = d0 / GROUP;
    let m0 = d0 % GROUP;
    let vecs = (w.nj + 3u) / 4u;
    var s = TokenSums();
    let own_at = windows_at(1u, false, w.r, g, m0, V_BITS, CV * V_BITS);
    let res_at = windows_at(1u, true, w.r, g, m0, V_RES_BITS, CV * V_RES_BITS);
    for (var j4 = first; j4 < vecs; j4 += step) {
        let p = prob4(w, j4);
        let pt = tokens_at(w, 4u * j4);
        var ps = p;
        if !folds_norms() {
            let own = params4(1u, false, w.r, g, pt);
            if !V_LEVELS {
                s.bias += own[1] * p;   // Lloyd-Max levels have no zero
            }
            ps = scale_cols(p, own[0]);
        }
        s.a = weigh_codes(s.a, windows4(1u, false, own_at, pt), V_BITS, table_of(1u), ps);
        if V_RESIDUAL {
            let res = params4(1u, true, w.r, g, pt);
            s.bias += res[1] * p;
            s.a = weigh_codes(s.a, windows4(1u, true, res_at, pt), V_RES_BITS, NUMBERS, scale_cols(p, res[0]));
        }
    }
    return s;
}

// s plus the chunk's ring segment (the sinks and the window) for channels d0 .. d0 + CV - 1,
// over its token vecs first, first + step, ... Reads the ring's probabilities: before `prob`
// holds other threads' sums.
fn plus_ring(w: Work, d0: u32, s: TokenSums, first: u32, step: u32) -> TokenSums {
    var o = s;
    if CV == 4u {
        o.a.m0 += ring_sums(w, d0, first, step, false).lo;
        return o;
    }
    // CV 16 of a head a multiple of 16: one walk over the ring's tokens.
    if CV == 16u && DIM % 16u == 0u {
        let a = ring_sums16(w, d0, first, step);
        o.a.m0 += a.m0;
        o.a.m1 += a.m1;
        o.a.m2 += a.m2;
        o.a.m3 += a.m3;
        return o;
    }
    // Else 8 channels a walk (past an odd D's last word the reads are clamped, and those
    // channels are not stored).
    let a = ring_sums(w, d0, first, step, true);
    o.a.m0 += a.lo;
    o.a.m1 += a.hi;
    if CV > 8u {
        let b = ring_sums(w, d0 + 8u, first, step, true);
        o.a.m2 += b.lo;
        o.a.m3 += b.hi;
    }
    return o;
}

// Writes a thread's sums of channels d0 .. d0 + CV - 1.
fn store_sums(w: Work, d0: u32, s: TokenSums) {
    store_values(w, d0, add_cols(s.a.m0, s.bias));
    if CV > 4u {
        store_values(w, d0 + 4u, add_cols(s.a.m1, s.bias));
    }
    if CV > 8u {
        store_values(w, d0 + 8u, add_cols(s.a.m2, s.bias));
        store_values(w, d0 + 12u, add_cols(s.a.m3, s.bias));
    }
}

// Sums slot i in `prob` (CV + 1 vec4s: the bias, then CV / 4 matrices' columns).
fn put_sums(i: u32, s: TokenSums) {
    let at = i * (CV + 1u);
    prob[at] = s.bias;
    put_mat(at + 1u, s.a.m0);
    if CV > 4u {
        put_mat(at + 5u, s.a.m1);
    }
    if CV > 8u {
        put_mat(at + 9u, s.a.m2);
        put_mat(at + 13u, s.a.m3);
    }
}

fn put_mat(at: u32, m: mat4x4<f32>) {
    prob[at] = m[0];
    prob[at + 1u] = m[1];
    prob[at + 2u] = m[2];
    prob[at + 3u] = m[3];
}

fn get_mat(at: u32) -> mat4x4<f32> {
    return mat4x4<f32>(prob[at], prob[at + 1u], prob[at + 2u], prob[at + 3u]);
}

// s plus the sums of slot i.
fn plus_sums(s: TokenSums, i: u32) -> TokenSums {
    let at = i * (CV + 1u);
    var o = s;
    o.bias += prob[at];
    o.a.m0 += get_mat(at + 1u);
    if CV > 4u {
        o.a.m1 += get_mat(at + 5u);
    }
    if CV > 8u {
        o.a.m2 += get_mat(at + 9u);
        o.a.m3 += get_mat(at + 13u);
    }
    return o;
}

// Value phase of values grouped along D: a thread a block of CV channels (blocks lid,
// lid + WG, ...), or with VP > 1 a block's token vecs dealt to VP threads in turn (blocks x
// VP <= WG, so every lane of a narrow workgroup has work: thread lid takes block lid % blocks,
// phase lid / blocks), the block's and the ring's alike (the ring's all on the first phase
// made the chunk holding the window its launch's slowest). Once every thread is done reading
// `prob`, the threads past the first phase leave their sums there ((VP - 1) x blocks slots of
// CV + 1 vec4s, within CHUNK), and the first phase's add them up and write. `token_sums` is
// called once (every call is compiled into the pipeline). Called in uniform control flow.
fn token_values(w: Work, lid: u32) {
    let blocks = (DIM + CV - 1u) / CV;
    let first = select(lid, lid % blocks, VP > 1u);
    let ph = select(0u, lid / blocks, VP > 1u);
    var s = TokenSums();
    for (var cb = first; cb < blocks; cb += WG) {
        s = TokenSums();
        if ph < VP {
            s = plus_ring(w, cb * CV, token_sums(w, cb * CV, ph, VP), ph, VP);
        }
        if VP == 1u {
            store_sums(w, cb * CV, s);
        }
    }
    if VP == 1u {
        return;
    }
    workgroupBarrier();
    if ph > 0u && ph < VP {
        put_sums((ph - 1u) * blocks + first, s);
    }
    workgroupBarrier();
    if ph == 0u {
        for (var k = 1u; k < VP; k++) {
            s = plus_sums(s, (k - 1u) * blocks + first);
        }
        store_sums(w, first * CV, s);
    }
}

// A chunk's workgroup before its segments: skips a chunk no query of the tile sees (an empty
// partial), loads the queries (visible to the whole workgroup on return); false when there is
// nothing to do.
fn begin(w: Work, lid: u32) -> bool {
    if chunk_first_pos(w) > tile_last_pos(w) {
        write_empty(w, lid);
        return false;
    }
    load_queries(w, lid);
    if !ROTATE_Q {
        workgroupBarrier();   // hadamard_qs ends with one
    }
    return true;
}

// Between the key and the value phase: the softmax partial (`b`: the block segment).
fn middle(w: Work, b: Work, lid: u32) {
    workgroupBarrier();
    softmax_partial(w, b, lid);
    workgroupBarrier();
}

// Heads of 16, 32 or 64 channels in a CPU adapter's narrow workgroups (WG 8: one SIMD
// group) rotate their output back in one pass over `qs`: a thread takes the channels of one
// residue mod 4 (all the butterflies left between them) in registers, where the stages
// through `qs` take a barrier and a pass each (on lavapipe the default cache's 256-token
// decode step 1.06-1.11x the f16 cache's with them, 0.99-1.01x in one pass; on SwiftShader
// 1.02-1.04x, 1.00-1.01x). Wider heads, and a GPU's wide workgroups (whose threads share the
// stages; one pass would leave all but 4 idle: not measured there), keep the stages in `qs`.
fn one_pass_back() -> bool {
    return ROTATE_OUT && DIM >= 16u && DIM <= 64u && WG <= 8u;
}

// Threads of the pass: one per residue, or per pair of them for f16 output (a word holds
// channels 2i and 2i + 1).
fn pass_threads() -> u32 {
    return select(4u, 2u, OUT_F16);
}

// The output channels c + 4j + 16k (c < 4; j < 4, k < D / 16) from the sums in `qs` (after
// the butterflies of h = 1 and 2): the butterflies of h = 4 and 8 (over j), then 16 and 32
// (over k), in the order the stages through `qs` take them (each channel sees the same
// sums), signed with `stream`'s signs and scaled by 1 / sqrt(D). Matrix k, column j: channel
// c + 4j + 16k, a vec4 over the queries. Constant indices only (llvmpipe keeps those in
// registers). Called after a barrier that publishes `qs`.
fn rotated_back_mod4(c: u32, stream: u32) -> array<mat4x4<f32>, 4> {
    var m: array<mat4x4<f32>, 4>;
    m[0] = hadamard4(mat4x4<f32>(qs[c], qs[c + 4u], qs[c + 8u], qs[c + 12u]));
    if DIM >= 32u {
        m[1] = hadamard4(mat4x4<f32>(qs[c + 16u], qs[c + 20u], qs[c + 24u], qs[c + 28u]));
    }
    if DIM >= 64u {
        m[2] = hadamard4(mat4x4<f32>(qs[c + 32u], qs[c + 36u], qs[c + 40u], qs[c + 44u]));
        m[3] = hadamard4(mat4x4<f32>(qs[c + 48u], qs[c + 52u], qs[c + 56u], qs[c + 60u]));
    }
    var o = m;
    if DIM == 64u {
        o = across4(m);
    } else if DIM == 32u {
        o[0] = m[0] + m[1];
        o[1] = m[0] - m[1];
    }
    o[0] = signed4(o[0], c, stream);
    if DIM >= 32u {
        o[1] = signed4(o[1], c + 16u, stream);
    }
    if DIM >= 64u {
        o[2] = signed4(o[2], c + 32u, stream);
        o[3] = signed4(o[3], c + 48u, stream);
    }
    return o;
}

// Column j (channel d + 4j) times its sign and 1 / sqrt(D).
fn signed4(m: mat4x4<f32>, d: u32, stream: u32) -> mat4x4<f32> {
    let norm = 1.0 / sqrt(f32(DIM));
    return mat4x4<f32>(
        m[0] * (sign_of(stream, d) * norm),
        m[1] * (sign_of(stream, d + 4u) * norm),
        m[2] * (sign_of(stream, d + 8u) * norm),
        m[3] * (sign_of(stream, d + 12u) * norm),
    );
}

// The butterflies of h = 16 and 32 of 64 channels: column j of the 4 matrices, a radix-4
// step each.
fn across4(m: array<mat4x4<f32>, 4>) -> array<mat4x4<f32>, 4> {
    let j0 = hadamard4(mat4x4<f32>(m[0][0], m[1][0], m[2][0], m[3][0]));
    let j1 = hadamard4(mat4x4<f32>(m[0][1], m[1][1], m[2][1], m[3][1]));
    let j2 = hadamard4(mat4x4<f32>(m[0][2], m[1][2], m[2][2], m[3][2]));
    let j3 = hadamard4(mat4x4<f32>(m[0][3], m[1][3], m[2][3], m[3][3]));
    return array<mat4x4<f32>, 4>(
        mat4x4<f32>(j0[0], j1[0], j2[0], j3[0]),
        mat4x4<f32>(j0[1], j1[1], j2[1], j3[1]),
        mat4x4<f32>(j0[2], j1[2], j2[2], j3[2]),
        mat4x4<f32>(j0[3], j1[3], j2[3], j3[3]),
    );
}

// Query q's channels at, at + 4, at + 8, at + 12 of the output (from `rotated_back_mod4`'s
// columns of `a`; with OUT_F16 each with the next channel's, from `b`, in one word).
fn finish4(at: u32, a: mat4x4<f32>, b: mat4x4<f32>, q: u32) {
    finish1(at, a[0][q], b[0][q]);
    finish1(at + 4u, a[1][q], b[1][q]);
    finish1(at + 8u, a[2][q], b[2][q]);
    finish1(at + 12u, a[3][q], b[3][q]);
}

fn finish1(at: u32, a: f32, b: f32) {
    if OUT_F16 {
        partials[at / 2u] = pack2x16float(vec2<f32>(a, b));
    } else {
        partials[at] = bitcast<u32>(a);
    }
}

// DIRECT with ROTATE_OUT: the normalised sums in `qs` rotated back (the values' signs of
// row r) and written.
fn finish(w: Work, lid: u32) {
    if !(DIRECT && ROTATE_OUT) {
        return;
    }
    let stream = dims.o_stream | (w.r % dims.kv_heads);
    if one_pass_back() {
        workgroupBarrier();
        for (var t = lid; t < pass_threads(); t += WG) {
            let c = select(t, 2u * t, OUT_F16);
            let a = rotated_back_mod4(c, stream);
            var b = a;
            if OUT_F16 {
                b = rotated_back_mod4(c + 1u, stream);
            }
            for (var q = 0u; q < w.nq; q++) {
                let at = out_index(w.r, w.q0 + q) + c;
                finish4(at, a[0], b[0], q);
                if DIM >= 32u {
                    finish4(at + 16u, a[1], b[1], q);
                }
                if DIM >= 64u {
                    finish4(at + 32u, a[2], b[2], q);
                    finish4(at + 48u, a[3], b[3], q);
                }
            }
        }
        return;
    }
    if DIM >= 8u {
        let h = hadamard_qs_but_last(lid, 4u);
        for (var p = lid; p < h / 2u; p += WG) {
            let o = rotated_back(h, p, stream);
            for (var k = 0u; k < last_radix(h); k++) {
                let d = o.d + k * h;
                for (var q = 0u; q < w.nq; q++) {
                    let at = out_index(w.r, w.q0 + q) + d;
                    if OUT_F16 {
                        partials[at / 2u] = pack2x16float(vec2<f32>(o.a[k][q], o.b[k][q]));
                    } else {
                        partials[at] = bitcast<u32>(o.a[k][q]);
                        partials[at + 1u] = bitcast<u32>(o.b[k][q]);
                    }
                }
            }
        }
        return;
    }
    hadamard_qs(lid, select(1u, 4u, DIM >= 4u));
    let norm = 1.0 / sqrt(f32(DIM));
    if OUT_F16 {
        for (var wd = lid; wd < DIM / 2u; wd += WG) {
            let a = qs[2u * wd] * (sign_of(stream, 2u * wd) * norm);
            let b = qs[2u * wd + 1u] * (sign_of(stream, 2u * wd + 1u) * norm);
            for (var q = 0u; q < w.nq; q++) {
                let o = out_index(w.r, w.q0 + q);
                partials[o / 2u + wd] = pack2x16float(vec2<f32>(a[q], b[q]));
            }
        }
    } else {
        for (var d = lid; d < DIM; d += WG) {
            let a = qs[d] * (sign_of(stream, d) * norm);
            for (var q = 0u; q < w.nq; q++) {
                partials[out_index(w.r, w.q0 + q) + d] = bitcast<u32>(a[q]);
            }
        }
    }
}

// A block of quantized tokens (one page's codes, params and residual for K and V), then the
// ring (the sinks and the window), as the dispatch has them: the block's key phase, the
// ring's scores, the softmax, the value phase of both, the output. One entry point per key
// phase and value phase, so a pipeline carries only the phases it runs: a driver compiles
// the code a constant makes dead before it folds it away (on lavapipe a pipeline with every
// phase took ~2 s to build, with its own ~0.5 s). Keys grouped along tokens (or GENERIC):
// `attend_block*`; along D: `attend_block_token_keys*`, in runs of 16 without a residual
// `attend_block_runs*`. Values grouped along D (not GENERIC): `*_token_values`. The
// workgroup's control flow is uniform: every invocation takes the same branches.

@compute @workgroup_size(WG)
fn attend_block(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = work_of(wg);
    if !w.valid || !begin(w, lid) {
        return;
    }
    let b = segment(w, BLOCK);
    if b.nj > 0u {
        block_scores(b, lid);
    }
    values_along_tokens(w, b, lid);
}

@compute @workgroup_size(WG)
fn attend_block_token_values(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = work_of(wg);
    if !w.valid || !begin(w, lid) {
        return;
    }
    let b = segment(w, BLOCK);
    if b.nj > 0u {
        block_scores(b, lid);
    }
    values_per_token(w, b, lid);
}

@compute @workgroup_size(WG)
fn attend_block_token_keys(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = work_of(wg);
    if !w.valid || !begin(w, lid) {
        return;
    }
    let b = segment(w, BLOCK);
    if b.nj > 0u {
        token_scores(b, lid);
    }
    values_along_tokens(w, b, lid);
}

@compute @workgroup_size(WG)
fn attend_block_token_keys_token_values(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = work_of(wg);
    if !w.valid || !begin(w, lid) {
        return;
    }
    let b = segment(w, BLOCK);
    if b.nj > 0u {
        token_scores(b, lid);
    }
    values_per_token(w, b, lid);
}

@compute @workgroup_size(WG)
fn attend_block_runs(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = work_of(wg);
    if !w.valid || !begin(w, lid) {
        return;
    }
    let b = segment(w, BLOCK);
    if b.nj > 0u {
        token_run_scores(b, lid);
    }
    values_along_tokens(w, b, lid);
}

@compute @workgroup_size(WG)
fn attend_block_runs_token_values(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = work_of(wg);
    if !w.valid || !begin(w, lid) {
        return;
    }
    let b = segment(w, BLOCK);
    if b.nj > 0u {
        token_run_scores(b, lid);
    }
    values_per_token(w, b, lid);
}

// After the block's key phase, values grouped along tokens (or GENERIC): the ring's scores,
// the softmax partial, the value phase, the output.
fn values_along_tokens(w: Work, b: Work, lid: u32) {
    f16_scores(w, lid);
    middle(w, b, lid);
    if b.nj == 0u {
        ring_values(w, lid);
    } else {
        block_values(b, lid);
    }
    finish(w, lid);
}

// `values_along_tokens` for values grouped along D.
fn values_per_token(w: Work, b: Work, lid: u32) {
    f16_scores(w, lid);
    middle(w, b, lid);
    if b.nj == 0u {
        ring_values(w, lid);
    } else {
        token_values(b, lid);
    }
    finish(w, lid);
}

// The ring segment's terms of channels d0 .. d0 + 3 (2 words) in this chunk, and with `wide`
// of d0 + 4 .. d0 + 7 (2 more) from the same tokens' addresses and probabilities: matrix c
// of `lo` (`hi`) is channel d0 + c (d0 + 4 + c), column q query q (its 4 tokens' terms,
// summed by `col_sums` at the end). Where a token's 8 channels are one load (`quads`),
// `ring_sums` takes `ring_dot` instead.
struct RingTerms {
    lo: Mats4,
    hi: Mats4,
}

fn ring_block(w: Work, d0: u32, first: u32, step: u32, wide: bool) -> RingTerms {
    let dw0 = d0 / 2u;
    let vecs = (w.nj + 3u) / 4u;   // probabilities past the segment's tokens are 0
    var a: RingTerms;
    for (var j4 = first; j4 < vecs; j4 += step) {
        let p = prob4(w, j4);
        let x = ring_values4(w, j4, dw0, wide);
        a.lo.m0 += scale_cols(p, x.w0[0]);
        a.lo.m1 += scale_cols(p, x.w0[1]);
        a.lo.m2 += scale_cols(p, x.w1[0]);
        a.lo.m3 += scale_cols(p, x.w1[1]);
        if wide {
            a.hi.m0 += scale_cols(p, x.w2[0]);
            a.hi.m1 += scale_cols(p, x.w2[1]);
            a.hi.m2 += scale_cols(p, x.w3[0]);
            a.hi.m3 += scale_cols(p, x.w3[1]);
        }
    }
    return a;
}

// Words dw0 .. dw0 + 1 (dw0 .. dw0 + 3 with `wide`; past the row: its last) of the 4 ring
// tokens of vec j4, as `ring_quads`: for 2 words one load a token where D is a multiple of 4
// (`ring_pair`), else a word a load (`ring4`; 4 words where D is a multiple of 8 are
// `ring_dot`'s).
fn ring_values4(w: Work, j4: u32, dw0: u32, wide: bool) -> RingQuads {
    let b = ring_bases(w, w.j0 + 4u * j4);
    if !wide && DIM % 4u == 0u {
        let x = ring_pair(1u, b, dw0);
        return RingQuads(x.w0, x.w1, mat2x4<f32>(), mat2x4<f32>());
    }
    let last = (DIM + 1u) / 2u - 1u;
    var x = RingQuads(ring4(1u, b, dw0), ring4(1u, b, min(dw0 + 1u, last)), mat2x4<f32>(), mat2x4<f32>());
    if wide {
        x.w2 = ring4(1u, b, min(dw0 + 2u, last));
        x.w3 = ring4(1u, b, min(dw0 + 3u, last));
    }
    return x;
}

// Key phase of the chunk's ring segment (the sinks and the window), if it has one.
fn f16_scores(c: Work, lid: u32) {
    if WITH_RING {
        let r = segment(c, RING);
        if r.nj > 0u {
            ring_scores(r, lid);
        }
    }
}

// Per query (columns), sums of 4 channels each (`lo`: d0 .. d0 + 3; `hi`: the next 4).
struct Sums8 {
    lo: mat4x4<f32>,
    hi: mat4x4<f32>,
}

// The chunk's ring segment (the sinks and the window) summed for channels d0 .. d0 + 3
// (`lo`; with `wide` also d0 + 4 .. d0 + 7, `hi`: one pass over the ring's tokens), per query
// over its token vecs first, first + step, ... (every vec: 0, 1).
fn ring_sums(c: Work, d0: u32, first: u32, step: u32, wide: bool) -> Sums8 {
    if d0 >= DIM || !WITH_RING {
        return Sums8();
    }
    let r = segment(c, RING);
    if r.nj == 0u {
        return Sums8();
    }
    if wide && quads() {
        let a = ring_dot(r, d0, first, step, false);
        return Sums8(a.m0, a.m1);
    }
    let a = ring_block(r, d0, first, step, wide);
    let lo = mat4x4<f32>(col_sums(a.lo.m0), col_sums(a.lo.m1), col_sums(a.lo.m2), col_sums(a.lo.m3));
    let hi = mat4x4<f32>(col_sums(a.hi.m0), col_sums(a.hi.m1), col_sums(a.hi.m2), col_sums(a.hi.m3));
    return Sums8(lo, hi);
}

// The ring segment r's sums of channels d0 .. d0 + 7 (m0, m1; with `wide16` d0 .. d0 + 15:
// m0 .. m3; D a multiple of 8, d0 of 8) over its token vecs first, first + step, ...: per
// channel a vec4 over the queries (column k of m<i>: channel d0 + 4i + k), each token's 16
// bytes of 8 channels weighed by the 4 tokens' probabilities at once. `ring_block` keeps a
// matrix over tokens per channel instead, four times the sums a walk carries (on llvmpipe
// each stored under the lanes' mask: the f16 cache's attention at 256 tokens ~5% slower so).
fn ring_dot(r: Work, d0: u32, first: u32, step: u32, wide16: bool) -> Mats4 {
    var a = Mats4();
    let dw0 = d0 / 2u;
    let vecs = (r.nj + 3u) / 4u;   // probabilities past the segment's tokens are 0
    for (var j4 = first; j4 < vecs; j4 += step) {
        let p = prob4(r, j4);
        let b = ring_bases(r, r.j0 + 4u * j4);
        let x = ring_quads(1u, b, dw0);
        a.m0 += mat4x4<f32>(x.w0[0] * p, x.w0[1] * p, x.w1[0] * p, x.w1[1] * p);
        a.m1 += mat4x4<f32>(x.w2[0] * p, x.w2[1] * p, x.w3[0] * p, x.w3[1] * p);
        if wide16 {
            let y = ring_quads(1u, b, dw0 + 4u);
            a.m2 += mat4x4<f32>(y.w0[0] * p, y.w0[1] * p, y.w1[0] * p, y.w1[1] * p);
            a.m3 += mat4x4<f32>(y.w2[0] * p, y.w2[1] * p, y.w3[0] * p, y.w3[1] * p);
        }
    }
    return a;
}

// The chunk's ring segment (the sinks and the window) summed for channels d0 .. d0 + 15 (D a
// multiple of 16) in one walk over its token vecs first, first + step, ... (`ring_dot`).
fn ring_sums16(c: Work, d0: u32, first: u32, step: u32) -> Mats4 {
    if !WITH_RING {
        return Mats4();
    }
    let r = segment(c, RING);
    if r.nj == 0u {
        return Mats4();
    }
    return ring_dot(r, d0, first, step, true);
}

// Value phase of a chunk of the ring alone in blocks of 16 channels, a block's tokens split
// over RP threads (blocks x RP <= WG; a CPU adapter's launches of several chunks: a thread's
// loads of 4 tokens' probabilities serve 16 channels, not 8). The threads past the first
// phase leave their sums in `prob` (slots of 16 vec4s) for the first to add up and write.
fn ring_values16(w: Work, lid: u32) {
    let blocks = max(DIM / 16u, 1u);   // (a pipeline of a narrower head validates it too)
    let cb = lid % blocks;
    let ph = lid / blocks;
    var a = Mats4();
    if ph < RP {
        a = ring_sums16(w, 16u * cb, ph, RP);
    }
    workgroupBarrier();   // every thread is done reading the probabilities
    if ph > 0u && ph < RP {
        let slot = 16u * ((ph - 1u) * blocks + cb);
        put_mat(slot, a.m0);
        put_mat(slot + 4u, a.m1);
        put_mat(slot + 8u, a.m2);
        put_mat(slot + 12u, a.m3);
    }
    workgroupBarrier();
    if ph == 0u {
        for (var k = 1u; k < RP; k++) {
            let at = 16u * ((k - 1u) * blocks + cb);
            a.m0 += get_mat(at);
            a.m1 += get_mat(at + 4u);
            a.m2 += get_mat(at + 8u);
            a.m3 += get_mat(at + 12u);
        }
        store_values(w, 16u * cb, a.m0);
        store_values(w, 16u * cb + 4u, a.m1);
        store_values(w, 16u * cb + 8u, a.m2);
        store_values(w, 16u * cb + 12u, a.m3);
    }
}

// Value phase of a chunk of the ring alone: per block of RC channels (one pass of a narrow
// workgroup's threads over a head of 64 in blocks of 8), per block of 16 split over RP
// threads (`ring_values16`), or per block of 4 with its tokens split over RP threads as
// `token_values` splits a block's (slots of 4 vec4s). Called in uniform control flow.
fn ring_values(w: Work, lid: u32) {
    if RC == 16u {
        ring_values16(w, lid);
        return;
    }
    if RC == 8u {
        for (var cb = lid; cb < DIM / 8u; cb += WG) {
            let s = ring_sums(w, 8u * cb, 0u, 1u, true);
            store_values(w, 8u * cb, s.lo);
            store_values(w, 8u * cb + 4u, s.hi);
        }
        return;
    }
    let blocks = (DIM + 3u) / 4u;
    if RP == 1u {
        for (var cb = lid; cb < blocks; cb += WG) {
            store_values(w, 4u * cb, ring_sums(w, 4u * cb, 0u, 1u, false).lo);
        }
        return;
    }
    let cb = lid % blocks;
    let ph = lid / blocks;
    var acc = mat4x4<f32>();
    if ph < RP {
        acc = ring_sums(w, 4u * cb, ph, RP, false).lo;
    }
    merge_phases(w, cb, ph, blocks, RP, acc);
}

// The ring alone: the sinks and the window of an XQuant cache, or a whole f16 cache.
@compute @workgroup_size(WG)
fn attend_ring(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = work_of(wg);
    if !w.valid || !begin(w, lid) {
        return;
    }
    f16_scores(w, lid);
    var none = w;
    none.nj = 0u;
    middle(w, none, lid);
    ring_values(w, lid);
    finish(w, lid);
}

// Query qi of row r over every chunk: the largest chunk max m (x) and 1 / the total weight
// (y; 0 when no chunk saw a token).
fn merged_stats(r: u32, qi: u32) -> vec2<f32> {
    let base = partial_at(r, qi, 0u);
    var m = NEG;
    for (var s = 0u; s < dims.slots; s++) {
        let at = base + s * (DIM + 2u);
        if partial(at + DIM + 1u) > 0.0 {
            m = max(m, partial(at + DIM));
        }
    }
    var l = 0.0;
    for (var s = 0u; s < dims.slots; s++) {
        let at = base + s * (DIM + 2u);
        let ls = partial(at + DIM + 1u);
        if ls > 0.0 {
            l += ls * exp(partial(at + DIM) - m);
        }
    }
    return vec2<f32>(m, select(0.0, 1.0 / l, l > 0.0));
}

// Channels d0 .. d0 + n - 1 (n <= 4, past D: 0) of query qi of row r merged over the chunks
// (`st`: its merged_stats).
fn merged_channels(r: u32, qi: u32, d0: u32, n: u32, st: vec2<f32>) -> vec4<f32> {
    let base = partial_at(r, qi, 0u);
    var v = vec4<f32>(0.0);
    for (var s = 0u; s < dims.slots; s++) {
        let at = base + s * (DIM + 2u);
        let ls = partial(at + DIM + 1u);
        if ls > 0.0 {
            let e = exp(partial(at + DIM) - st.x);
            for (var c = 0u; c < n; c++) {
                if d0 + c < DIM {
                    v[c] += partial(at + d0 + c) * e;
                }
            }
        }
    }
    return v * st.y;
}

// `finish4` for `combine`'s output.
fn combined4(at: u32, a: mat4x4<f32>, b: mat4x4<f32>, q: u32) {
    combined1(at, a[0][q], b[0][q]);
    combined1(at + 4u, a[1][q], b[1][q]);
    combined1(at + 8u, a[2][q], b[2][q]);
    combined1(at + 12u, a[3][q], b[3][q]);
}

fn combined1(at: u32, a: f32, b: f32) {
    if OUT_F16 {
        out[at / 2u] = pack2x16float(vec2<f32>(a, b));
    } else {
        out[at] = bitcast<u32>(a);
    }
}

// Merges the partials of every chunk: one workgroup per (row, tile of up to 4 queries), one
// invocation per output word (a channel, or a pair of channels for f16 output) of each query;
// ROTATE_OUT (D >= 8): per 4 channels, rotated back together, a query a column of `qs`.
@compute @workgroup_size(WG)
fn combine(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let id = wg.y * dims.grid_x + wg.x;
    let tiles = (dims.q_per_row + 3u) / 4u;
    let r = id / tiles;
    let q0 = (id % tiles) * 4u;
    if r >= dims.rows {
        return;
    }
    let nq = min(4u, dims.q_per_row - q0);
    var m = vec4<f32>(NEG);
    var inv = vec4<f32>(0.0);
    for (var c = 0u; c < nq; c++) {
        let st = merged_stats(r, q0 + c);
        m[c] = st.x;
        inv[c] = st.y;
    }
    let stream = dims.o_stream | (r % dims.kv_heads);
    if ROTATE_OUT && DIM >= 8u {
        // The stages of the two lowest bits in registers, the others in `qs`, the last as
        // the output is written.
        for (var p = lid; p < DIM / 4u; p += WG) {
            var e: mat4x4<f32>;   // rows: queries, columns: channels 4p ..
            for (var c = 0u; c < nq; c++) {
                e[c] = merged_channels(r, q0 + c, 4u * p, 4u, vec2<f32>(m[c], inv[c]));
            }
            e = hadamard4(transpose(e));
            for (var k = 0u; k < 4u; k++) {
                qs[4u * p + k] = e[k];
            }
        }
        if one_pass_back() {
            workgroupBarrier();
            for (var t = lid; t < pass_threads(); t += WG) {
                let c = select(t, 2u * t, OUT_F16);
                let a = rotated_back_mod4(c, stream);
                var b = a;
                if OUT_F16 {
                    b = rotated_back_mod4(c + 1u, stream);
                }
                for (var q = 0u; q < nq; q++) {
                    let at = out_index(r, q0 + q) + c;
                    combined4(at, a[0], b[0], q);
                    if DIM >= 32u {
                        combined4(at + 16u, a[1], b[1], q);
                    }
                    if DIM >= 64u {
                        combined4(at + 32u, a[2], b[2], q);
                        combined4(at + 48u, a[3], b[3], q);
                    }
                }
            }
            return;
        }
        let h = hadamard_qs_but_last(lid, 4u);
        for (var p = lid; p < h / 2u; p += WG) {
            let o = rotated_back(h, p, stream);
            for (var k = 0u; k < last_radix(h); k++) {
                let d = o.d + k * h;
                for (var c = 0u; c < nq; c++) {
                    let at = out_index(r, q0 + c) + d;
                    if OUT_F16 {
                        out[at / 2u] = pack2x16float(vec2<f32>(o.a[k][c], o.b[k][c]));
                    } else {
                        out[at] = bitcast<u32>(o.a[k][c]);
                        out[at + 1u] = bitcast<u32>(o.b[k][c]);
                    }
                }
            }
        }
        return;
    }
    let per_word = select(1u, 2u, OUT_F16);
    for (var wd = lid; wd * per_word < DIM; wd += WG) {
        var lo = vec4<f32>(0.0);
        var hi = vec4<f32>(0.0);
        for (var c = 0u; c < nq; c++) {
            let v = merged_channels(r, q0 + c, wd * per_word, per_word, vec2<f32>(m[c], inv[c])).xy;
            let o = out_index(r, q0 + c);
            if ROTATE_OUT {
                lo[c] = v.x;
                hi[c] = v.y;
            } else if OUT_F16 {
                out[(o >> 1u) + wd] = pack2x16float(v);
            } else {
                out[o + wd] = bitcast<u32>(v.x);
            }
        }
        if ROTATE_OUT {
            // D < 8: every channel into `qs` first, rotated back below as it is written.
            qs[wd * per_word] = lo;
            if OUT_F16 {
                qs[2u * wd + 1u] = hi;
            }
        }
    }
    if ROTATE_OUT {
        hadamard_qs(lid, 1u);
        let norm = 1.0 / sqrt(f32(DIM));
        for (var wd = lid; wd * per_word < DIM; wd += WG) {
            let d = wd * per_word;
            let lo = qs[d] * (sign_of(stream, d) * norm);
            if OUT_F16 {
                let hi = qs[d + 1u] * (sign_of(stream, d + 1u) * norm);
                for (var c = 0u; c < nq; c++) {
                    out[(out_index(r, q0 + c) >> 1u) + wd] = pack2x16float(vec2<f32>(lo[c], hi[c]));
                }
            } else {
                for (var c = 0u; c < nq; c++) {
                    out[out_index(r, q0 + c) + wd] = bitcast<u32>(lo[c]);
                }
            }
        }
    }
}
