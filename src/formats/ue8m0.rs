//! UE8M0 block scales: byte `e` is `2^(e - 127)`. `e = 255` is reserved (rejected);
//! `e = 0` is `2^-127`, an f32 subnormal (bits `0x0040_0000`), not zero.

/// Decoded value of every byte; entry 255 is NaN and validated inputs never hold it.
pub static TABLE: [f32; 256] = build_table();

const fn build_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    t[0] = f32::from_bits(0x0040_0000);
    let mut e = 1;
    while e < 255 {
        t[e] = f32::from_bits((e as u32) << 23);
        e += 1;
    }
    t[255] = f32::NAN;
    t
}

/// Decode one scale byte.
#[inline]
pub fn decode(e: u8) -> f32 {
    TABLE[e as usize]
}

/// The exponent byte of the smallest power of two `>= x`, clamped to `[1, 254]`
/// (what the quantizers emit). `x` must be finite and positive; otherwise byte 1 or 254.
pub fn encode_ceil(x: f32) -> u8 {
    if x.is_nan() || x <= 0.0 {
        return 1;
    }
    if !x.is_finite() {
        return 254;
    }
    let bits = x.to_bits();
    let exp = (bits >> 23) as i32;
    let mant = bits & 0x7F_FFFF;
    let e = if exp == 0 {
        // Subnormal: below 2^-126, so the ceiling power of two is at most 2^-126.
        1
    } else if mant == 0 {
        exp
    } else {
        exp + 1
    };
    e.clamp(1, 254) as u8
}
