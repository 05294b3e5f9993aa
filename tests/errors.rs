//! Bad input gets a typed error, allocates nothing on the GPU and leaves the context usable.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::gpu::{assert_no_gpu_errors, block};
use xquant_wgpu::kvfile::KvFile;
use xquant_wgpu::reference::{self, pair_layers};
use xquant_wgpu::{DType, ParamsPrecision, QuantSpec, TensorShape, ValueAxis, XqError};

fn kind(r: Result<impl std::fmt::Debug, XqError>) -> &'static str {
    r.expect_err("expected an error").kind()
}

#[test]
fn shapes_and_specs_are_validated() {
    assert_eq!(kind(TensorShape::new(&[5])), "ShapeError");
    assert_eq!(kind(TensorShape::new(&[2, 0, 4])), "ShapeError");
    assert_eq!(kind(TensorShape::new(&[1 << 16, 1 << 16])), "ShapeError");
    for bad in [
        QuantSpec::new(0, 32),
        QuantSpec::new(9, 32),
        QuantSpec::new(2, 0),
        QuantSpec::new(2, 5000),
        QuantSpec {
            eta: -0.1,
            ..Default::default()
        },
        QuantSpec {
            eta: 0.6,
            ..Default::default()
        },
        QuantSpec {
            eta: f32::NAN,
            ..Default::default()
        },
    ] {
        assert_eq!(kind(bad.validate()), "ConfigError", "{bad:?}");
    }
    assert_eq!(kind(pair_layers(4, 0)), "ConfigError");
    assert_eq!(kind(ValueAxis::parse("rows")), "ConfigError");
    // The CPU reference checks lengths and values too.
    let spec = QuantSpec::new(2, 4);
    assert_eq!(
        kind(reference::quantize_codes(&[1.0; 7], 4, 2, &spec)),
        "ShapeError"
    );
    assert_eq!(
        kind(reference::quantize_codes(
            &[1.0, f32::INFINITY, 0.0, 0.0],
            2,
            2,
            &spec
        )),
        "NonFiniteError"
    );
}

#[test]
fn gpu_rejects_bad_input_without_side_effects() {
    let ctx = gpu_or_skip!();
    let p = ParamsPrecision::F16;
    assert_eq!(
        kind(ctx.upload_f32(&[1.0, f32::NAN], &[1, 2], p)),
        "NonFiniteError"
    );
    assert_eq!(
        kind(ctx.upload_f32(&[1.0, f32::NEG_INFINITY], &[1, 2], p)),
        "NonFiniteError"
    );
    assert_eq!(
        kind(ctx.upload_f16(&[0x7c00, 0], &[1, 2], p)),
        "NonFiniteError"
    ); // +Inf half
    assert_eq!(
        kind(ctx.upload_f32(&[20000.0, 0.0], &[1, 2], p)),
        "NonFiniteError"
    );
    assert!(ctx
        .upload_f32(&[20000.0, 0.0], &[1, 2], ParamsPrecision::F32)
        .is_ok());
    assert_eq!(kind(ctx.upload_f32(&[1.0; 5], &[2, 2], p)), "ShapeError");
    assert_eq!(kind(ctx.upload_f32(&[], &[0, 2], p)), "ShapeError");

    let x = ctx
        .upload_f32(&xquant_wgpu::synth::normal(2 * 40 * 6, 1), &[2, 40, 6], p)
        .unwrap();
    let other = ctx
        .upload_f32(&xquant_wgpu::synth::normal(2 * 41 * 6, 2), &[2, 41, 6], p)
        .unwrap();
    assert_eq!(
        kind(block(ctx.quantize(&x, &QuantSpec::new(9, 32)))),
        "ConfigError"
    );
    let q = block(ctx.quantize(&x, &QuantSpec::new(2, 32))).unwrap();
    // Codes of another shape, bit width or axis do not fit.
    assert_eq!(
        kind(block(ctx.compute_reuse_params(
            &other,
            &q.codes,
            &QuantSpec::new(2, 32)
        ))),
        "ShapeError"
    );
    assert_eq!(
        kind(block(ctx.reuse_fit(
            &x,
            &q.codes,
            &QuantSpec::new(3, 32),
            2,
            DType::F16
        ))),
        "ShapeError"
    );
    let channels = QuantSpec {
        axis: ValueAxis::Channels,
        ..QuantSpec::new(2, 32)
    };
    assert_eq!(
        kind(block(ctx.reuse_fit(&x, &q.codes, &channels, 0, DType::F16))),
        "ShapeError"
    );
    assert_eq!(
        kind(block(ctx.reuse_fit(
            &x,
            &q.codes,
            &QuantSpec::new(2, 32),
            9,
            DType::F16
        ))),
        "ConfigError"
    );
    assert_eq!(
        kind(block(ctx.quantize_residual(
            &x,
            &other,
            2,
            &QuantSpec::new(2, 32),
            DType::F32
        ))),
        "ShapeError"
    );
    let q3 = block(ctx.quantize(&x, &QuantSpec::new(3, 32))).unwrap();
    assert_eq!(
        kind(block(ctx.dequant(&q.codes, &q3.params, DType::F32))),
        "ShapeError"
    );
    assert_eq!(
        kind(block(ctx.cross_layer_similarity(&x, &other))),
        "ShapeError"
    );
    assert_eq!(
        kind(block(ctx.similarities(&[&x], &[(0, 1)]))),
        "ShapeError"
    );

    // Still usable, and nothing escaped as a GPU error.
    let again = block(ctx.dequant(&q.codes, &q.params, DType::F32)).unwrap();
    assert_eq!(block(ctx.read_f32(&again)).unwrap().len(), 2 * 40 * 6);
    assert_no_gpu_errors(&ctx);
}

#[test]
fn too_large_is_a_typed_error() {
    let ctx = gpu_or_skip!();
    let limit = ctx.max_binding_bytes();
    // A tensor whose f32 bytes exceed one storage binding: refused before any allocation.
    let elems = (limit / 4 + 1) as usize;
    let shape = TensorShape::new(&[elems, 1]);
    if let Ok(shape) = shape {
        let zeros = vec![0f32; shape.len()];
        assert_eq!(
            kind(ctx.upload_f32(&zeros, shape.dims(), ParamsPrecision::F32)),
            "TooLargeError"
        );
    }
    assert_no_gpu_errors(&ctx);
}

#[test]
fn kv_files_are_validated() {
    assert_eq!(kind(KvFile::from_bytes(b"short")), "FormatError");
    let mut huge_header = (1u64 << 40).to_le_bytes().to_vec();
    huge_header.extend_from_slice(b"{}");
    assert_eq!(kind(KvFile::from_bytes(&huge_header)), "FormatError");
    let file = |header: &str, data: usize| {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.resize(b.len() + data, 0);
        b
    };
    let cases = [
        (r#"[1,2]"#, 0, "FormatError"),
        (
            r#"{"past_key_values.0.key":{"dtype":"I8","shape":[1,1,2,2],"data_offsets":[0,4]}}"#,
            4,
            "FormatError",
        ),
        (
            r#"{"past_key_values.0.key":{"dtype":"F32","shape":[1,1,2,2],"data_offsets":[0,99]}}"#,
            16,
            "FormatError",
        ),
        (
            r#"{"past_key_values.0.key":{"dtype":"F32","shape":[1,1,2,2],"data_offsets":[0,16]}}"#,
            16,
            "FormatError",
        ),
        (
            r#"{"past_key_values.0.key":{"dtype":"F32","shape":[2,2,2],"data_offsets":[0,32]},
                "past_key_values.0.value":{"dtype":"F32","shape":[2,2,2],"data_offsets":[32,64]}}"#,
            64,
            "ShapeError",
        ),
    ];
    for (header, data, want) in cases {
        assert_eq!(
            kind(KvFile::from_bytes(&file(header, data))),
            want,
            "{header}"
        );
    }
}
