//! The reference implementation's golden values (`shared/golden/seed_primitives_70x8.json`,
//! copied into `tests/data/`), with the inputs regenerated from their formula.

use serde_json::Value;

/// N tokens, D channels, bits, group size and residual bits of the golden case.
pub const N: usize = 70;
pub const D: usize = 8;
pub const BITS: u8 = 2;
pub const GROUP: usize = 32;
pub const RESIDUAL_BITS: u8 = 4;

pub struct Golden {
    pub json: Value,
}

fn f16(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

impl Golden {
    pub fn load() -> Golden {
        let text = include_str!("../data/seed_primitives_70x8.json");
        Golden {
            json: serde_json::from_str(text).expect("golden json parses"),
        }
    }

    /// `x[i, j] = f16(sin(0.37 i + 1.3 j) (1 + 0.1 j))`, computed in f32 as the reference did.
    pub fn x() -> Vec<f32> {
        let mut x = Vec::with_capacity(N * D);
        for i in 0..N {
            for j in 0..D {
                let (i, j) = (i as f32, j as f32);
                x.push(f16((0.37f32 * i + 1.3f32 * j).sin() * (1.0 + 0.1 * j)));
            }
        }
        x
    }

    /// `y = f16(f32(x) · 1.1 + 0.05)`.
    pub fn y() -> Vec<f32> {
        Golden::x().iter().map(|&v| f16(v * 1.1 + 0.05)).collect()
    }

    /// A field flattened to f32 in row-major order.
    pub fn flat(&self, field: &str) -> Vec<f32> {
        fn walk(v: &Value, out: &mut Vec<f32>) {
            match v {
                Value::Array(a) => a.iter().for_each(|e| walk(e, out)),
                Value::Number(n) => out.push(n.as_f64().expect("number") as f32),
                other => panic!("unexpected golden value {other}"),
            }
        }
        let mut out = Vec::new();
        walk(&self.json[field], &mut out);
        assert!(!out.is_empty(), "golden field {field} is missing");
        out
    }

    pub fn sim(&self, key: &str) -> f64 {
        self.json["sim"][key].as_f64().expect("sim field")
    }
}
