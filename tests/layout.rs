//! The packed format: every bit width round-trips exactly, and allocated bytes equal the
//! packed size (dense whenever group_size · bits is a multiple of 32).
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::gpu::block;
use xquant_wgpu::layout::GroupLayout;
use xquant_wgpu::synth::SplitMix;
use xquant_wgpu::{Levels, ParamsPrecision, QuantSpec, TensorShape, ValueAxis};

#[test]
fn pack_unpack_round_trips_every_width() {
    let mut g = SplitMix::new(11);
    for bits in 1..=8u8 {
        for group_size in [1, 3, 5, 7, 13, 32, 33] {
            for axis in [ValueAxis::Tokens, ValueAxis::Channels] {
                let shape = TensorShape::new(&[2, 1 + g.range(0, 40), 1 + g.range(0, 20)]).unwrap();
                let layout = GroupLayout::new(
                    &shape,
                    &QuantSpec {
                        axis,
                        ..QuantSpec::new(bits, group_size)
                    },
                );
                let codes: Vec<u8> = (0..layout.unpacked_len())
                    .map(|_| (g.next_u64() % (1 << bits)) as u8)
                    .collect();
                let words = layout.pack(&codes);
                assert_eq!(words.len(), layout.code_words());
                assert_eq!(
                    layout.unpack(&words),
                    codes,
                    "bits {bits} group {group_size} {axis:?}"
                );
            }
        }
    }
}

#[test]
fn dense_when_group_bits_fill_words() {
    for bits in 1..=8u8 {
        let shape = TensorShape::new(&[8, 4096, 128]).unwrap();
        let layout = GroupLayout::new(&shape, &QuantSpec::new(bits, 32));
        assert_eq!(
            layout.code_bytes() * 8,
            shape.len() * bits as usize,
            "bits {bits}"
        );
    }
    // A group of 5 at 3 bits uses 15 of 32 bits per word: the layout says so.
    let layout = GroupLayout::new(
        &TensorShape::new(&[1, 10, 4]).unwrap(),
        &QuantSpec::new(3, 5),
    );
    assert_eq!(layout.words_per_group(), 1);
    assert_eq!(layout.code_bytes(), 2 * 4 * 4);
}

#[test]
fn gpu_allocates_exactly_the_packed_size() {
    let ctx = gpu_or_skip!();
    for (bits, params) in [
        (2u8, ParamsPrecision::F16),
        (3, ParamsPrecision::F32),
        (8, ParamsPrecision::F16),
    ] {
        let dims = [1, 3, 96, 64];
        let spec = QuantSpec {
            params,
            ..QuantSpec::new(bits, 32)
        };
        let x = ctx
            .upload_f32(&xquant_wgpu::synth::normal(3 * 96 * 64, 5), &dims, params)
            .unwrap();
        let q = block(ctx.quantize(&x, &spec)).unwrap();
        let elements = 3 * 96 * 64;
        assert_eq!(
            q.codes.allocated_bytes() as usize,
            elements * bits as usize / 8
        );
        let cells = 3 * 3 * 64;
        assert_eq!(
            q.params.allocated_bytes() as usize,
            cells * params.pair_bytes()
        );
    }
}

/// Lloyd–Max norms: one per cell, f32 words or f16 halves with each row `(r, g)` starting a
/// word (odd `O` pads it); packing then unpacking gives the norms back as storage keeps them,
/// and the words are exactly what the layout says it allocates.
#[test]
fn norms_pack_and_unpack_in_their_layout() {
    let mut g = SplitMix::new(21);
    for (group_size, d) in [(2, 6), (4, 16), (8, 8), (3, 9)] {
        for tokens in [1, 2, 7, 32] {
            let shape = TensorShape::new(&[2, tokens, d]).unwrap();
            let spec = QuantSpec {
                axis: ValueAxis::Channels,
                levels: Levels::LloydMax,
                ..QuantSpec::new(2, group_size)
            };
            let layout = GroupLayout::new(&shape, &spec);
            let norms: Vec<f32> = (0..layout.cells())
                .map(|_| g.normal().abs() * 10.0)
                .collect();
            for precision in [ParamsPrecision::F16, ParamsPrecision::F32] {
                let words = layout.pack_norms(&norms, precision);
                assert_eq!(4 * words.len(), layout.params_bytes(precision));
                let want: Vec<f32> = norms.iter().map(|&v| precision.store(v)).collect();
                assert_eq!(layout.unpack_norms(&words, precision), want);
            }
            let rows = 2 * layout.n_groups();
            assert_eq!(
                layout.params_bytes(ParamsPrecision::F16),
                4 * rows * tokens.div_ceil(2),
                "{group_size} {d} {tokens}: f16 norms, rows start words"
            );
        }
    }
}
