//! E2M1 (fp4): code = `sign << 3 | idx`, magnitudes `{0, 0.5, 1, 1.5, 2, 3, 4, 6}`.
//! Packed two per byte, element `2i` in the low nibble.

use super::round_half_even;
use crate::error::{Error, Result};

/// Largest finite magnitude.
pub const MAX: f32 = 6.0;

/// Decoded value of each of the 16 codes (`0x8` is -0.0).
pub static TABLE: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Twice the value of each code: an integer in [-12, 12]. Products of two are `4 * q * k`.
pub static DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Decode one code (the low nibble of `c`).
#[inline]
pub fn decode(c: u8) -> f32 {
    TABLE[(c & 0xF) as usize]
}

/// Element `i` of a packed row (`packed[i / 2]`, low nibble for even `i`).
#[inline]
pub fn unpack(packed: &[u8], i: usize) -> u8 {
    let b = packed[i / 2];
    if i.is_multiple_of(2) {
        b & 0xF
    } else {
        b >> 4
    }
}

/// Pack codes two per byte, element `2i` in the low nibble. `codes.len()` must be even.
pub fn pack(codes: &[u8]) -> Vec<u8> {
    codes
        .chunks(2)
        .map(|p| (p[0] & 0xF) | (p.get(1).copied().unwrap_or(0) << 4))
        .collect()
}

/// Encode an f32: round to nearest, ties to even, saturating to ±6.
/// A result that rounds to zero is `+0`. NaN or infinity is an error.
pub fn encode(x: f32) -> Result<u8> {
    if !x.is_finite() {
        return Err(Error::BadFloat {
            field: "e2m1 input".into(),
            index: 0,
            value: x,
            expected: "finite",
        });
    }
    let a = (x as f64).abs();
    if a >= MAX as f64 {
        return Ok(if x < 0.0 { 0xF } else { 0x7 });
    }
    // Grid spacing 0.5 below 2, 1 in [2, 4), 2 in [4, 8).
    let quantum = if a < 2.0 {
        0.5
    } else if a < 4.0 {
        1.0
    } else {
        2.0
    };
    let v = (round_half_even(a / quantum) * quantum).min(MAX as f64);
    if v == 0.0 {
        return Ok(0);
    }
    let idx = (0u8..8)
        .find(|&c| TABLE[c as usize] as f64 == v)
        .unwrap_or(7);
    Ok(if x < 0.0 { idx | 0x8 } else { idx })
}
