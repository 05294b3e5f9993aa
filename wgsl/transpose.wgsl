// Token-major tensors [B, T, H, D] (a runtime's projections: one token's heads side by side)
// into the heads-major [B, H, T, D] the caches and attention read: a bit copy, f32 words or
// f16 halves. One invocation writes one word of the output.

struct Dims {
    batch: u32,
    tokens: u32,   // T
    heads: u32,    // H
    dim: u32,      // D
    words: u32,    // output words
    grid_x: u32,   // workgroups along x
    _pad0: u32,
    _pad1: u32,
}

override F16: bool = false; // halves (two per word) instead of f32 words
override WG: u32 = 256u;

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> x: array<u32>;        // [B, T, H, D]
@group(0) @binding(2) var<storage, read_write> y: array<u32>;  // [B, H, T, D]

// The element of x that element e of y is.
fn source(e: u32) -> u32 {
    let d = e % dims.dim;
    let t = (e / dims.dim) % dims.tokens;
    let h = (e / (dims.dim * dims.tokens)) % dims.heads;
    let b = e / (dims.dim * dims.tokens * dims.heads);
    return ((b * dims.tokens + t) * dims.heads + h) * dims.dim + d;
}

// The bits of half e of x.
fn half_of(e: u32) -> u32 {
    return (x[e >> 1u] >> (16u * (e & 1u))) & 0xffffu;
}

@compute @workgroup_size(WG)
fn tokens_to_heads(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = (wg.y * dims.grid_x + wg.x) * WG + lid;
    if w >= dims.words {
        return;
    }
    if F16 {
        // An odd element count leaves the last word's high half zero.
        let n = dims.batch * dims.tokens * dims.heads * dims.dim;
        var hi = 0u;
        if 2u * w + 1u < n {
            hi = half_of(source(2u * w + 1u));
        }
        y[w] = half_of(source(2u * w)) | (hi << 16u);
    } else {
        y[w] = x[source(w)];
    }
}
