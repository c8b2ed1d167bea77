//! The quantizers of SPEC 2, in f32 arithmetic: `x / scale` as one f32 division,
//! then round to nearest even with saturation.

use super::{e2m1, e4m3, ue8m0};
use crate::error::{Error, Result};

/// The floor applied before the fp4 block scale is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp4Floor {
    /// DeepGEMM: `scale = pow2ceil(max(amax, 1e-4) / 6)`.
    #[default]
    AmaxFloor,
    /// SGLang's V4.1 key packer: `scale = pow2ceil(max(amax / 6, 1e-4))`.
    ScaleFloor,
}

/// How the fp8 per-key scale is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Scale {
    /// `scale = max(amax, 1e-4) / 448` as an f32.
    #[default]
    Exact,
    /// The same, rounded up to a power of two (DeepSeek-V3.2).
    PowerOfTwo,
}

const FLOOR: f32 = 1e-4;

fn check_finite(x: &[f32], field: &str, base: usize) -> Result<f32> {
    let mut amax = 0.0f32;
    for (i, &v) in x.iter().enumerate() {
        if !v.is_finite() {
            return Err(Error::BadFloat {
                field: field.into(),
                index: base + i,
                value: v,
                expected: "finite",
            });
        }
        amax = amax.max(v.abs());
    }
    Ok(amax)
}

/// Quantize one row to fp4 with a UE8M0 scale per 32 elements.
/// Returns packed codes (`len / 2` bytes) and scale bytes (`len / 32`).
/// `x.len()` must be a positive multiple of 32.
pub fn quantize_fp4_blocks(x: &[f32], floor: Fp4Floor) -> Result<(Vec<u8>, Vec<u8>)> {
    if x.is_empty() || !x.len().is_multiple_of(32) {
        return Err(Error::range("x.len", x.len(), "a positive multiple of 32"));
    }
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / 32);
    for (g, group) in x.chunks(32).enumerate() {
        let amax = check_finite(group, "x", g * 32)?;
        let s = match floor {
            Fp4Floor::AmaxFloor => amax.max(FLOOR) / 6.0,
            Fp4Floor::ScaleFloor => (amax / 6.0).max(FLOOR),
        };
        let e = ue8m0::encode_ceil(s);
        let scale = ue8m0::decode(e);
        scales.push(e);
        for &v in group {
            codes.push(e2m1::encode(v / scale)?);
        }
    }
    Ok((e2m1::pack(&codes), scales))
}

/// Quantize one row (a key) to E4M3 with one f32 scale. Returns codes and the scale.
pub fn quantize_fp8_rows(x: &[f32], mode: Fp8Scale) -> Result<(Vec<u8>, f32)> {
    let amax = check_finite(x, "x", 0)?;
    let mut scale = amax.max(FLOOR) / e4m3::MAX;
    if mode == Fp8Scale::PowerOfTwo {
        scale = ue8m0::decode(ue8m0::encode_ceil(scale));
    }
    let codes = x
        .iter()
        .map(|&v| e4m3::encode(v / scale))
        .collect::<Result<Vec<u8>>>()?;
    Ok((codes, scale))
}
