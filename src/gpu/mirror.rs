//! Uniform structs shared with WGSL. Each is declared once with [`wgsl_struct!`], which
//! derives the `repr(C)` Rust type and records its members (name, offset, size) and the
//! WGSL struct it mirrors; the contract test (`gpu::contract`) checks every record against
//! the shader as naga lays it out.

use crate::gpu::pipelines::Family;

/// One member of a mirrored struct (read by the contract test).
#[cfg_attr(not(all(test, not(target_arch = "wasm32"))), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    pub name: &'static str,
    pub offset: usize,
    pub size: usize,
}

/// A Rust struct that mirrors a WGSL struct member for member.
#[cfg_attr(not(all(test, not(target_arch = "wasm32"))), allow(dead_code))]
pub trait WgslStruct: bytemuck::Pod {
    /// The WGSL file that declares the struct.
    const FAMILY: Family;
    /// The struct's name in that file.
    const WGSL_NAME: &'static str;
    /// Members in declaration order.
    fn members() -> Vec<Member>;
}

/// Declares a `repr(C)` uniform struct mirrored from `wgsl/<family>.wgsl`:
/// `wgsl_struct! { /// doc \n pub(crate) struct Name = Family::X "WgslName" { a: u32, ... } }`.
macro_rules! wgsl_struct {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident = $family:path, $wgsl:literal {
            $($field:ident: $ty:ty),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
        $vis struct $name {
            $(pub $field: $ty),*
        }

        impl $crate::gpu::mirror::WgslStruct for $name {
            const FAMILY: $crate::gpu::pipelines::Family = $family;
            const WGSL_NAME: &'static str = $wgsl;
            fn members() -> Vec<$crate::gpu::mirror::Member> {
                vec![$($crate::gpu::mirror::Member {
                    name: stringify!($field),
                    offset: std::mem::offset_of!($name, $field),
                    size: std::mem::size_of::<$ty>(),
                }),*]
            }
        }
    };
}
pub(crate) use wgsl_struct;
