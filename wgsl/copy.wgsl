// The bandwidth roofline for benchmarks: copy 16-byte vectors, one per invocation.

struct Dims {
    vec4s: u32,  // 16-byte vectors to copy
    grid_x: u32, // workgroups along x
    _pad0: u32,
    _pad1: u32,
}

override WG: u32 = 256u;

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<u32>>;

@compute @workgroup_size(WG)
fn copy(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wg.y * dims.grid_x + wg.x) * WG + lid;
    if i < dims.vec4s {
        dst[i] = src[i];
    }
}
