//! E4M3 (`float8_e4m3fn`): 1 sign, 4 exponent (bias 7), 3 mantissa bits.
//! Max ±448, smallest subnormal 2^-9, no infinities, `0x7F`/`0xFF` are NaN.

use super::round_half_even;
use crate::error::{Error, Result};

/// Largest finite magnitude.
pub const MAX: f32 = 448.0;

const fn decode_const(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
    let e = ((b >> 3) & 0xF) as i32;
    let m = (b & 0x7) as i32;
    if e == 0xF && m == 0x7 {
        return f32::NAN;
    }
    // value = m * 2^-9 (subnormal) or (8 + m) * 2^(e - 10) (normal); both exact.
    let (int, exp) = if e == 0 { (m, -9) } else { (8 + m, e - 10) };
    let mut v = int as f32;
    let mut k = 0;
    if exp >= 0 {
        while k < exp {
            v *= 2.0;
            k += 1;
        }
    } else {
        while k < -exp {
            v *= 0.5;
            k += 1;
        }
    }
    sign * v
}

const fn build_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode_const(i as u8);
        i += 1;
    }
    t
}

/// Decoded value of every byte (NaN for `0x7F` and `0xFF`).
pub static TABLE: [f32; 256] = build_table();

/// Decode one byte. `0x7F` and `0xFF` decode to NaN; validated inputs never hold them.
#[inline]
pub fn decode(b: u8) -> f32 {
    TABLE[b as usize]
}

/// True for the two NaN codes.
#[inline]
pub fn is_nan_code(b: u8) -> bool {
    b & 0x7F == 0x7F
}

/// Encode an f32: round to nearest, ties to even, saturating to ±448.
/// A result that rounds to zero is `+0` (`0x00`). NaN or infinity is an error.
pub fn encode(x: f32) -> Result<u8> {
    if !x.is_finite() {
        return Err(Error::BadFloat {
            field: "e4m3 input".into(),
            index: 0,
            value: x,
            expected: "finite",
        });
    }
    let a = (x as f64).abs();
    if a >= MAX as f64 {
        return Ok(if x < 0.0 { 0xFE } else { 0x7E });
    }
    // Grid spacing: 2^-9 below 2^-6 (subnormals), else 2^(floor(log2 a) - 3).
    let e = if a < 2f64.powi(-6) {
        -6
    } else {
        a.log2().floor() as i32
    };
    // log2 may be off by one near powers of two; fix up exactly.
    let e = if e > -6 && 2f64.powi(e) > a {
        e - 1
    } else if 2f64.powi(e + 1) <= a {
        e + 1
    } else {
        e
    };
    let quantum = 2f64.powi(e.max(-6) - 3);
    let q = round_half_even(a / quantum);
    let v = q * quantum;
    if v == 0.0 {
        return Ok(0x00);
    }
    let v = v.min(MAX as f64);
    // Reverse lookup on the positive half of the table (monotonic in the code).
    let code = (0u8..0x7F)
        .find(|&c| TABLE[c as usize] as f64 == v)
        .unwrap_or(0x7E);
    Ok(if x < 0.0 { code | 0x80 } else { code })
}
