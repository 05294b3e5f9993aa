// Cross-layer similarity: for pairs of layers (a, b) of V vectors of D channels each,
// sum of (a - b)^2 and sum over vectors of a.b / max(|a||b|, 1e-8); then means.
// Stage 1 (`pair_partials`): one invocation per vector, a workgroup tree-reduces to one
// partial per (pair, workgroup); pairs index layers of `a` and `b` (the same buffer when
// the layers are stacked, or one layer each). Stage 2 (`finish`): one invocation per pair sums partials.

struct Dims {
    vectors: u32,      // V per layer
    dim: u32,          // D
    layer_stride: u32, // elements per layer in `a` / `b`
    n_pairs: u32,      // pairs in `pairs` (stage 1) or in total (stage 2)
    partials: u32,     // workgroups along x in stage 1 = partials per pair
    pair_base: u32,    // stage 1 writes the partials of pair i at row pair_base + i
    row_vectors: u32,  // WEIGHTED: vectors per row of `weights`
    _pad1: u32,
}

override A_F16: bool = false;     // `a` holds f16 pairs instead of f32
override B_F16: bool = false;
override WEIGHTED: bool = false; // weight squared differences by `weights`
override WG: u32 = 256u;

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> a: array<u32>;       // [La, V, D] f32 bits or f16 pairs
@group(0) @binding(2) var<storage, read> b: array<u32>;       // [Lb, V, D]
@group(0) @binding(3) var<storage, read> pairs: array<u32>;   // [n_pairs] layer_a | layer_b << 16
@group(0) @binding(4) var<storage, read_write> part: array<vec2<f32>>; // [P, partials] (sum sq, sum cos)
@group(0) @binding(5) var<storage, read_write> result: array<vec2<f32>>; // [P] (mse, mean cosine)
@group(0) @binding(6) var<storage, read> weights: array<f32>;      // WEIGHTED: [rows, D]

var<workgroup> scratch: array<vec2<f32>, WG>;

fn load_a(e: u32) -> f32 {
    if A_F16 {
        return unpack2x16float(a[e >> 1u])[e & 1u];
    }
    return bitcast<f32>(a[e]);
}

fn load_b(e: u32) -> f32 {
    if B_F16 {
        return unpack2x16float(b[e >> 1u])[e & 1u];
    }
    return bitcast<f32>(b[e]);
}

@compute @workgroup_size(WG)
fn pair_partials(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let pair = pairs[wg.y];
    let v = wg.x * WG + lid;
    var acc = vec2<f32>(0.0, 0.0);
    if v < dims.vectors {
        let base_a = (pair & 0xffffu) * dims.layer_stride + v * dims.dim;
        let base_b = (pair >> 16u) * dims.layer_stride + v * dims.dim;
        var dot = 0.0;
        var na = 0.0;
        var nb = 0.0;
        var sq = 0.0;
        let w0 = (v / max(dims.row_vectors, 1u)) * dims.dim;
        for (var d = 0u; d < dims.dim; d++) {
            let x = load_a(base_a + d);
            let y = load_b(base_b + d);
            var w = 1.0;
            if WEIGHTED {
                w = weights[w0 + d];
            }
            sq += w * (x - y) * (x - y);
            dot += x * y;
            na += x * x;
            nb += y * y;
        }
        acc = vec2<f32>(sq, dot / max(sqrt(na) * sqrt(nb), 1e-8));
    }
    scratch[lid] = acc;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if lid < stride {
            scratch[lid] += scratch[lid + stride];
        }
        workgroupBarrier();
    }
    if lid == 0u {
        part[(dims.pair_base + wg.y) * dims.partials + wg.x] = scratch[0];
    }
}

@compute @workgroup_size(WG)
fn finish(@builtin(global_invocation_id) gid: vec3<u32>) {
    let p = gid.x;
    if p >= dims.n_pairs {
        return;
    }
    var total = vec2<f32>(0.0, 0.0);
    for (var i = 0u; i < dims.partials; i++) {
        total += part[p * dims.partials + i];
    }
    result[p] = vec2<f32>(total.x / f32(dims.vectors * dims.dim), total.y / f32(dims.vectors));
}
