//! The WGSL ↔ Rust contract, checked: every shader is parsed with naga (wgpu's own front end)
//! and compared with what the Rust side assumes — the uniform structs it mirrors (member
//! names, offsets, sizes), the `override` constants it sets (declared, same type, none
//! required left unset), and the shader-side bounds of what Rust accepts (array sizes and
//! workgroup memory).

use std::collections::BTreeMap;

use naga::proc::Layouter;
use naga::{AddressSpace, Module, ScalarKind, TypeInner};

use crate::gpu::context::MAX_BINDINGS;
use crate::gpu::dispatch::MAX_STORAGE;
use crate::gpu::kernels::attention::{chunk_tokens, AttnDims, Side, TT_MAX};
use crate::gpu::kernels::bench::CopyDims;
use crate::gpu::kernels::group_quant::GroupDims;
use crate::gpu::kernels::llama::LlamaDims;
use crate::gpu::kernels::materialize::MaterializeDims;
use crate::gpu::kernels::rotate::{RotateDims, HELD_ROTATION_DIM};
use crate::gpu::kernels::similarity::SimDims;
use crate::gpu::kernels::transpose::TransposeDims;
use crate::gpu::kernels::window::WindowDims;
use crate::gpu::mirror::{Member, WgslStruct};
use crate::gpu::pipelines::{
    Access, AttentionConstants, ConstValue, Constants, Family, GroupQuantConstants, LlamaConstants,
    MaterializeConstants, RotateConstants, SimilarityConstants, TransposeConstants,
    WindowConstants, ATTENTION_WG, ATTENTION_WG_CPU, ROTATE_WG_CPU,
};

/// WebGPU's default `maxComputeWorkgroupStorageSize`, what the library asks devices for.
const WORKGROUP_BYTES: usize = 16384;

const FAMILIES: [Family; 9] = [
    Family::GroupQuant,
    Family::Materialize,
    Family::Window,
    Family::Transpose,
    Family::Rotate,
    Family::Similarity,
    Family::Llama,
    Family::Attention,
    Family::Copy,
];

struct Mirror {
    family: Family,
    name: &'static str,
    size: usize,
    members: Vec<Member>,
}

fn mirror<T: WgslStruct>() -> Mirror {
    Mirror {
        family: T::FAMILY,
        name: T::WGSL_NAME,
        size: std::mem::size_of::<T>(),
        members: T::members(),
    }
}

/// Every Rust struct that mirrors a WGSL struct.
fn mirrors() -> Vec<Mirror> {
    vec![
        mirror::<GroupDims>(),
        mirror::<MaterializeDims>(),
        mirror::<WindowDims>(),
        mirror::<TransposeDims>(),
        mirror::<RotateDims>(),
        mirror::<SimDims>(),
        mirror::<LlamaDims>(),
        mirror::<AttnDims>(),
        mirror::<Side>(),
        mirror::<CopyDims>(),
    ]
}

fn parse(family: Family) -> Module {
    naga::front::wgsl::parse_str(family.source())
        .unwrap_or_else(|e| panic!("{family:?}: {}", e.emit_to_string(family.source())))
}

fn layouter(module: &Module) -> Layouter {
    let mut l = Layouter::default();
    l.update(module.to_ctx()).expect("layout");
    l
}

/// A struct's members as (name, offset, size).
type Members = Vec<(String, u32, u32)>;

/// Named structs of a module: name → (span, members).
fn structs(module: &Module) -> BTreeMap<String, (u32, Members)> {
    let layout = layouter(module);
    let mut out = BTreeMap::new();
    for (_, ty) in module.types.iter() {
        if let (Some(name), TypeInner::Struct { members, span }) = (&ty.name, &ty.inner) {
            let members = members
                .iter()
                .map(|m| {
                    let name = m.name.clone().unwrap_or_default();
                    (name, m.offset, layout[m.ty].size)
                })
                .collect();
            out.insert(name.clone(), (*span, members));
        }
    }
    out
}

#[test]
fn every_mirrored_struct_matches_its_wgsl_layout() {
    for m in mirrors() {
        let module = parse(m.family);
        let all = structs(&module);
        let (span, wgsl) = all
            .get(m.name)
            .unwrap_or_else(|| panic!("{:?}: no struct {} in the shader", m.family, m.name));
        let rust: Members = m
            .members
            .iter()
            .map(|f| (f.name.to_string(), f.offset as u32, f.size as u32))
            .collect();
        assert_eq!(
            &rust, wgsl,
            "{:?} {}: members (name, offset, size)",
            m.family, m.name
        );
        assert_eq!(m.size as u32, *span, "{:?} {}: size", m.family, m.name);
        // A uniform's members are written by bytemuck: no implicit padding may hide one.
        let covered: usize = m.members.iter().map(|f| f.size).sum();
        assert_eq!(
            covered, m.size,
            "{:?} {}: implicit padding",
            m.family, m.name
        );
    }
}

#[test]
fn every_uniform_struct_has_a_rust_mirror() {
    let mirrors = mirrors();
    for family in FAMILIES {
        let module = parse(family);
        let all = structs(&module);
        for (_, var) in module.global_variables.iter() {
            if var.space != AddressSpace::Uniform {
                continue;
            }
            let ty = &module.types[var.ty];
            let name = ty.name.clone().unwrap_or_default();
            let mirrored = |n: &str| mirrors.iter().any(|m| m.family == family && m.name == n);
            assert!(
                mirrored(&name),
                "{family:?}: uniform struct {name} has no Rust mirror"
            );
            // Structs nested in a mirrored uniform are mirrored too.
            for (member, _, _) in &all[&name].1 {
                let member_ty = match &ty.inner {
                    TypeInner::Struct { members, .. } => members
                        .iter()
                        .find(|m| m.name.as_deref() == Some(member))
                        .map(|m| &module.types[m.ty]),
                    _ => None,
                };
                if let Some(t) = member_ty.filter(|t| matches!(t.inner, TypeInner::Struct { .. })) {
                    let n = t.name.clone().unwrap_or_default();
                    assert!(
                        mirrored(&n),
                        "{family:?}: nested struct {n} has no Rust mirror"
                    );
                }
            }
        }
    }
}

#[test]
fn every_family_layout_declares_its_wgsl_bindings() {
    for family in FAMILIES {
        let module = parse(family);
        let mut declared = BTreeMap::new();
        for (_, var) in module.global_variables.iter() {
            let Some(binding) = &var.binding else {
                continue;
            };
            assert_eq!(
                binding.group, 0,
                "{family:?}: only bind group 0 is laid out"
            );
            let access = match var.space {
                AddressSpace::Uniform => Access::Uniform,
                AddressSpace::Storage { access } if access.contains(naga::StorageAccess::STORE) => {
                    Access::Write
                }
                AddressSpace::Storage { .. } => Access::Read,
                other => panic!("{family:?}: binding {} in {other:?}", binding.binding),
            };
            declared.insert(binding.binding, access);
        }
        // The entry points' layouts together declare every binding, each as WGSL does.
        let mut laid_out = BTreeMap::new();
        for entry in module.entry_points.iter() {
            for &(binding, access) in family.bindings(&entry.name) {
                laid_out.insert(binding, access);
            }
            let storage = family.bindings(&entry.name).len() - 1;
            assert!(
                storage <= MAX_STORAGE,
                "{family:?}::{}: {storage} storage bindings",
                entry.name
            );
        }
        assert_eq!(laid_out, declared, "{family:?}");
        assert_eq!(
            declared.get(&0),
            Some(&Access::Uniform),
            "{family:?}: binding 0 holds the dims"
        );
        let last = *declared.keys().last().unwrap_or(&0);
        assert!(
            u64::from(last) < MAX_BINDINGS,
            "{family:?}: raise MAX_BINDINGS"
        );
    }
}

/// Representative constants of every family, with every flag on where that is legal.
fn constant_sets() -> Vec<Constants> {
    vec![
        Constants::GroupQuant(GroupQuantConstants {
            bits: 2,
            res_bits: 4,
            group: 32,
            in_f16: true,
            x_to_f16: true,
            recon_f16: true,
            round_f16: true,
            params_f32: true,
            axis_channels: true,
        }),
        Constants::Materialize(MaterializeConstants {
            bits: 3,
            res_bits: 2,
            group: 32,
            out_f16: true,
            params_f32: true,
            axis_channels: true,
            levels: true,
            ..Default::default()
        }),
        Constants::Window(WindowConstants {
            in_f16: true,
            pair: true,
        }),
        Constants::Transpose(TransposeConstants { f16: true }),
        Constants::Rotate(RotateConstants {
            in_f16: true,
            out_f16: true,
            in_place: true,
            inverse: true,
            pair: true,
            to_ring: true,
            round_in: true,
            plain_first: true,
            from_ring: true,
            from_levels: true,
            bits: 2,
            group: 32,
            params_f32: true,
            dim: 64,
            wg: ROTATE_WG_CPU,
        }),
        Constants::Similarity(SimilarityConstants {
            a_f16: true,
            b_f16: true,
            weighted: true,
        }),
        Constants::Llama(LlamaConstants {
            weight: 2,
            accumulate: true,
            rotate: true,
            halves: true,
            gelu: true,
        }),
        Constants::Attention(AttentionConstants {
            wg: 8,
            dim: 64,
            group: 32,
            chunk: 512,
            tt: 16,
            cv: 16,
            vp: 2,
            rp: 2,
            split_block: true,
            rc: 8,
            ck: 16,
            qt: 4,
            generic: true,
            k_bits: 2,
            k_res_bits: 4,
            v_bits: 2,
            v_res_bits: 4,
            k_residual: true,
            v_residual: true,
            k_channels: true,
            v_channels: true,
            params_f32: true,
            q_f16: true,
            out_f16: true,
            direct: true,
            with_ring: true,
            own_codes: true,
            rotate_q: true,
            rotate_out: true,
            k_levels: true,
            v_levels: true,
            token_quads: true,
        }),
        Constants::Copy,
    ]
}

#[test]
fn every_constant_rust_sets_is_declared_with_its_type() {
    for constants in constant_sets() {
        let family = constants.family();
        let module = parse(family);
        let declared: BTreeMap<String, (TypeInner, bool)> = module
            .overrides
            .iter()
            .map(|(_, o)| {
                let name = o.name.clone().unwrap_or_default();
                (name, (module.types[o.ty].inner.clone(), o.init.is_some()))
            })
            .collect();
        let values = constants.values();
        for (name, value) in &values {
            let (ty, _) = declared
                .get(*name)
                .unwrap_or_else(|| panic!("{family:?}: Rust sets {name}, the shader has none"));
            let ok = match (value, ty) {
                (ConstValue::Bool(_), TypeInner::Scalar(s)) => s.kind == ScalarKind::Bool,
                (ConstValue::U32(_), TypeInner::Scalar(s)) => s.kind == ScalarKind::Uint,
                _ => false,
            };
            assert!(
                ok,
                "{family:?}: {name} is {ty:?} in the shader, Rust sets {value:?}"
            );
        }
        for (name, (_, has_default)) in &declared {
            let set = values.iter().any(|(n, _)| n == name);
            assert!(
                set || *has_default,
                "{family:?}: {name} has no default and Rust never sets it"
            );
        }
    }
}

/// The value of a module-scope `const` of type u32.
fn const_u32(module: &Module, name: &str) -> u32 {
    let (_, c) = module
        .constants
        .iter()
        .find(|(_, c)| c.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("no const {name}"));
    match module.global_expressions[c.init] {
        naga::Expression::Literal(naga::Literal::U32(v)) => v,
        ref e => panic!("const {name} is not a u32 literal: {e:?}"),
    }
}

#[test]
fn shader_bounds_match_what_rust_accepts() {
    let attention = parse(Family::Attention);
    assert_eq!(const_u32(&attention, "TT_MAX") as usize, TT_MAX);
    let llama = parse(Family::Llama);
    assert_eq!(
        const_u32(&llama, "FEW") as usize,
        crate::model::gpu::FEW_TOKENS,
        "matmul_few's accumulators must hold every token Rust sends it"
    );
}

/// `family`'s entry point `entry` with `constants` set (the override pass alone, as wgpu
/// and the browser get it: nothing pruned).
fn specialise(family: Family, entry: &str, constants: &Constants) -> Module {
    crate::gpu::specialise::with_overrides(family, entry, &constants.overrides())
        .unwrap_or_else(|e| panic!("{family:?} {entry}: constants apply: {e}"))
}

/// Bytes of workgroup memory `entry` uses with `constants` set.
fn workgroup_bytes(entry: &str, constants: &Constants) -> usize {
    let m = specialise(constants.family(), entry, constants);
    let layout = layouter(&m);
    m.global_variables
        .iter()
        .filter(|(_, v)| v.space == AddressSpace::WorkGroup)
        .map(|(_, v)| layout[v.ty].size as usize)
        .sum()
}

#[test]
fn workgroup_memory_fits_for_every_geometry_rust_chooses() {
    let mut checked = 0;
    for dim in (1..=1100).step_by(7).chain([64, 96, 128, 256, 1006, 1007]) {
        for (tt, wg) in [(4, ATTENTION_WG), (8, ATTENTION_WG_CPU), (16, ATTENTION_WG)] {
            let Some(chunk) = chunk_tokens(dim, tt, wg as usize, WORKGROUP_BYTES) else {
                continue;
            };
            let c = Constants::Attention(AttentionConstants {
                wg,
                dim: dim as u32,
                chunk: chunk as u32,
                tt: tt as u32,
                group: tt as u32,
                qt: 4,
                ..Default::default()
            });
            for entry in [
                "attend_block",
                "attend_block_token_values",
                "attend_block_token_keys",
                "attend_block_token_keys_token_values",
                "attend_block_runs",
                "attend_block_runs_token_values",
                "attend_ring",
            ] {
                let used = workgroup_bytes(entry, &c);
                assert!(
                    used <= WORKGROUP_BYTES,
                    "{entry} D {dim} TT {tt} CHUNK {chunk}: {used} bytes of workgroup memory"
                );
            }
            checked += 1;
        }
    }
    assert!(checked > 300, "only {checked} geometries checked");
    for constants in constant_sets() {
        let family = constants.family();
        let module = parse(family);
        for ep in &module.entry_points {
            let used = workgroup_bytes(&ep.name, &constants);
            assert!(
                used <= WORKGROUP_BYTES,
                "{family:?} {}: {used} bytes",
                ep.name
            );
            let m = specialise(family, &ep.name, &constants);
            let size: u32 = m.entry_points[0].workgroup_size.iter().product();
            assert!(
                (1..=256).contains(&size),
                "{family:?} {}: {size} invocations per workgroup",
                ep.name
            );
        }
    }
}

/// The text of WGSL function `name` in `source`, from `fn name(` to its closing brace.
fn wgsl_fn<'a>(source: &'a str, name: &str) -> &'a str {
    let start = source
        .find(&format!("fn {name}("))
        .unwrap_or_else(|| panic!("fn {name} not found"));
    let end = start + source[start..].find("\n}\n").expect("closing brace") + 2;
    &source[start..end]
}

/// `rotate_held` is built for a D up to `HELD_DIM` (the host's [`HELD_ROTATION_DIM`]),
/// the walks written out for that many elements.
#[test]
fn the_held_rotation_dim_is_the_shaders() {
    let want = format!("const HELD_DIM: u32 = {HELD_ROTATION_DIM}u;");
    assert!(Family::Rotate.source().contains(&want), "{want}");
}

/// The rotation's sign hash lives in two shaders (WGSL has no shared modules and shaders are
/// never spliced): `rotate.wgsl` rotates what enters a cache, `attention.wgsl` the queries and
/// outputs that meet it. Both must draw the same signs (and the CPU twin's, which
/// `rotate_matches_cpu` and the rotated attention tests check against the first).
#[test]
fn the_rotation_sign_hash_is_the_same_in_every_shader() {
    let rotate = Family::Rotate.source();
    let attention = Family::Attention.source();
    for name in ["mix", "sign_of"] {
        assert_eq!(wgsl_fn(rotate, name), wgsl_fn(attention, name), "fn {name}");
    }
}

/// The f16 conversions done with integer operations (and the unpacking of 8 halves), and
/// the Lloyd–Max levels of a vec4 of codes, live in several shaders (no shared modules, no splicing): every copy is the same.
#[test]
fn the_shared_conversions_are_the_same_in_every_shader() {
    let materialize = Family::Materialize.source();
    let rotate = Family::Rotate.source();
    let group_quant = Family::GroupQuant.source();
    for name in [
        "halves_to_f32",
        "halves8",
        "f16_bits4",
        "round_f16x4",
        "levels4",
    ] {
        assert_eq!(
            wgsl_fn(materialize, name),
            wgsl_fn(rotate, name),
            "fn {name}"
        );
    }
    for name in ["halves_to_f32", "f16_bits4", "round_f16x4"] {
        if group_quant.contains(&format!("fn {name}(")) {
            assert_eq!(
                wgsl_fn(materialize, name),
                wgsl_fn(group_quant, name),
                "fn {name}"
            );
        }
    }
}
