//! SPEC 2, exhaustively: every E4M3 byte, every E2M1 code, every UE8M0 byte, against
//! hand-written tables and the `float8` / `float4` crates; round trips and ties.

use dsa_indexer::formats::{
    e2m1, e4m3, quantize_fp4_blocks, quantize_fp8_rows, ue8m0, Fp4Floor, Fp8Scale,
};

/// E4M3 by fields: sign, exponent (bias 7), mantissa. Written out, not computed from the code.
fn e4m3_by_fields(b: u8) -> f64 {
    let s = if b >> 7 == 1 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0b1111) as i32;
    let m = (b & 0b111) as f64;
    if e == 0 {
        s * m / 8.0 * 2f64.powi(-6)
    } else {
        s * (1.0 + m / 8.0) * 2f64.powi(e - 7)
    }
}

#[test]
// E4M3 bytes are written grouped by field: sign, exponent, mantissa.
#[allow(clippy::unusual_byte_groupings)]
fn e4m3_all_256_bytes() {
    // Spot values by field.
    assert_eq!(e4m3::decode(0b0_0111_000), 1.0);
    assert_eq!(e4m3::decode(0b0_1111_110), 448.0);
    assert_eq!(e4m3::decode(0b1_1111_110), -448.0);
    assert_eq!(e4m3::decode(0b0_0000_001), 2f32.powi(-9));
    assert_eq!(e4m3::decode(0b0_0001_000), 2f32.powi(-6));
    assert_eq!(e4m3::decode(0b1_0000_000).to_bits(), (-0.0f32).to_bits());
    assert!(e4m3::decode(0x7F).is_nan() && e4m3::decode(0xFF).is_nan());
    for b in 0..=255u8 {
        let ours = e4m3::decode(b);
        let theirs = float8::F8E4M3::from_bits(b).to_f32();
        if b & 0x7F == 0x7F {
            assert!(ours.is_nan() && theirs.is_nan() && e4m3::is_nan_code(b));
            assert!(e4m3::encode(ours).is_err(), "NaN must not encode");
            continue;
        }
        assert!(!e4m3::is_nan_code(b));
        assert_eq!(ours as f64, e4m3_by_fields(b), "byte {b:#04x} by fields");
        assert_eq!(ours.to_bits(), theirs.to_bits(), "byte {b:#04x} vs float8");
        // Round trip: every finite code encodes back to itself, except -0 -> +0.
        let want = if b == 0x80 { 0x00 } else { b };
        assert_eq!(e4m3::encode(ours).unwrap(), want, "round trip {b:#04x}");
    }
}

#[test]
fn e4m3_encode_ties_saturation_and_agreement_with_float8() {
    // Midpoints between neighbours round to the even mantissa.
    let pos: Vec<u8> = (0..0x7F).collect();
    for w in pos.windows(2) {
        let (a, b) = (e4m3::decode(w[0]), e4m3::decode(w[1]));
        let mid = ((a as f64 + b as f64) / 2.0) as f32;
        assert_eq!(
            mid as f64,
            (a as f64 + b as f64) / 2.0,
            "midpoint exact in f32"
        );
        let even = if w[0] % 2 == 0 { w[0] } else { w[1] };
        assert_eq!(
            e4m3::encode(mid).unwrap(),
            even,
            "tie between {:#04x} and {:#04x}",
            w[0],
            w[1]
        );
        assert_eq!(
            e4m3::encode(-mid).unwrap(),
            if even == 0 { 0 } else { even | 0x80 }
        );
        // Just off the midpoint.
        assert_eq!(
            e4m3::encode(f32::from_bits(mid.to_bits() - 1)).unwrap(),
            w[0]
        );
        assert_eq!(
            e4m3::encode(f32::from_bits(mid.to_bits() + 1)).unwrap(),
            w[1]
        );
    }
    // Saturation and rounding to zero.
    for x in [448.0f32, 464.0, 480.0, 1e6, f32::MAX] {
        assert_eq!(e4m3::encode(x).unwrap(), 0x7E);
        assert_eq!(e4m3::encode(-x).unwrap(), 0xFE);
    }
    assert_eq!(
        e4m3::encode(2f32.powi(-10)).unwrap(),
        0x00,
        "half the smallest subnormal ties to 0"
    );
    assert_eq!(
        e4m3::encode(-1e-30).unwrap(),
        0x00,
        "rounds to zero encodes +0"
    );
    assert_eq!(e4m3::encode(-0.0).unwrap(), 0x00);
    assert!(e4m3::encode(f32::INFINITY).is_err() && e4m3::encode(f32::NAN).is_err());
    // float8 agrees inside the finite range (it does not saturate the same way above 448).
    let mut x = 1e-4f32;
    while x < 448.0 {
        for v in [x, -x] {
            let theirs = float8::F8E4M3::from_f32(v).to_bits();
            let ours = e4m3::encode(v).unwrap();
            let theirs = if theirs == 0x80 { 0 } else { theirs };
            assert_eq!(ours, theirs, "encode {v}");
        }
        x *= 1.0137;
    }
}

#[test]
fn e2m1_all_16_codes() {
    let table: [(u8, f32); 16] = [
        (0b0_000, 0.0),
        (0b0_001, 0.5),
        (0b0_010, 1.0),
        (0b0_011, 1.5),
        (0b0_100, 2.0),
        (0b0_101, 3.0),
        (0b0_110, 4.0),
        (0b0_111, 6.0),
        (0b1_000, -0.0),
        (0b1_001, -0.5),
        (0b1_010, -1.0),
        (0b1_011, -1.5),
        (0b1_100, -2.0),
        (0b1_101, -3.0),
        (0b1_110, -4.0),
        (0b1_111, -6.0),
    ];
    for (c, v) in table {
        assert_eq!(e2m1::decode(c).to_bits(), v.to_bits(), "code {c:#x}");
        assert_eq!(
            e2m1::decode(c).to_bits(),
            (float4::F4E2M1::from_bits(c).to_f64() as f32).to_bits(),
            "vs float4 {c:#x}"
        );
        assert_eq!(e2m1::DOUBLED[c as usize] as f32, 2.0 * v);
        assert_eq!(
            e2m1::encode(v).unwrap(),
            if c == 0x8 { 0 } else { c },
            "round trip {c:#x}"
        );
    }
    // Ties to even, saturation, zero.
    for (x, c) in [
        (0.25, 0u8),
        (0.75, 2),
        (1.25, 2),
        (1.75, 4),
        (2.5, 4),
        (3.5, 6),
        (5.0, 6),
        (7.0, 7),
        (100.0, 7),
    ] {
        assert_eq!(e2m1::encode(x).unwrap(), c, "encode {x}");
        assert_eq!(
            e2m1::encode(-x).unwrap(),
            if c == 0 { 0 } else { c | 8 },
            "encode {}",
            -x
        );
    }
    assert_eq!(e2m1::encode(-0.1).unwrap(), 0, "rounds to zero encodes +0");
    assert!(e2m1::encode(f32::NAN).is_err() && e2m1::encode(f32::NEG_INFINITY).is_err());
    // float4 agrees on a sweep (both round to nearest even and saturate).
    let mut x = 0.01f32;
    while x < 20.0 {
        for v in [x, -x] {
            let theirs = float4::F4E2M1::from_f64(v as f64).to_bits();
            let theirs = if theirs == 8 { 0 } else { theirs };
            assert_eq!(e2m1::encode(v).unwrap(), theirs, "encode {v}");
        }
        x *= 1.011;
    }
}

#[test]
fn e2m1_packing_low_nibble_first() {
    let codes = [0x1u8, 0x2, 0xF, 0x8, 0x7, 0x0];
    let packed = e2m1::pack(&codes);
    assert_eq!(packed, vec![0x21, 0x8F, 0x07]);
    for (i, &c) in codes.iter().enumerate() {
        assert_eq!(e2m1::unpack(&packed, i), c);
    }
}

#[test]
fn ue8m0_all_256_bytes() {
    assert_eq!(
        ue8m0::decode(0).to_bits(),
        0x0040_0000,
        "e = 0 is 2^-127, an f32 subnormal"
    );
    assert_eq!(ue8m0::decode(0) as f64, 2f64.powi(-127));
    assert_eq!(ue8m0::decode(127), 1.0);
    assert_eq!(ue8m0::decode(254), 2f32.powi(127));
    assert!(ue8m0::decode(255).is_nan());
    for e in 0..=254u8 {
        assert_eq!(
            ue8m0::decode(e) as f64,
            2f64.powi(e as i32 - 127),
            "byte {e}"
        );
        if e >= 1 {
            // Encoding a power of two gives its byte; just above it gives the next.
            assert_eq!(ue8m0::encode_ceil(ue8m0::decode(e)), e);
            if e < 254 {
                assert_eq!(
                    ue8m0::encode_ceil(f32::from_bits(ue8m0::decode(e).to_bits() + 1)),
                    e + 1
                );
            }
        }
    }
    // Clamped to [1, 254].
    assert_eq!(ue8m0::encode_ceil(1e-45), 1);
    assert_eq!(ue8m0::encode_ceil(f32::MAX), 254);
}

#[test]
fn fp4_block_quantizer_floors() {
    // amax = 0: DeepGEMM floors amax at 1e-4 -> 1e-4/6 -> 2^-15 (byte 112);
    // SGLang floors amax/6 at 1e-4 -> 2^-13 (byte 114).
    let zeros = [0.0f32; 32];
    let (p, s) = quantize_fp4_blocks(&zeros, Fp4Floor::AmaxFloor).unwrap();
    assert_eq!((p, s), (vec![0; 16], vec![112]));
    let (_, s) = quantize_fp4_blocks(&zeros, Fp4Floor::ScaleFloor).unwrap();
    assert_eq!(s, vec![114]);
    // amax = 6 -> scale 1; values map to their own codes.
    let mut x = [0.0f32; 32];
    x[..8].copy_from_slice(&[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]);
    x[8] = -6.0;
    let (p, s) = quantize_fp4_blocks(&x, Fp4Floor::AmaxFloor).unwrap();
    assert_eq!(s, vec![127]);
    assert_eq!(&p[..5], &[0x10, 0x32, 0x54, 0x76, 0x0F]);
    // amax = 7 -> 7/6 -> scale 2.
    x[0] = 7.0;
    let (_, s) = quantize_fp4_blocks(&x, Fp4Floor::AmaxFloor).unwrap();
    assert_eq!(s, vec![128]);
    assert!(quantize_fp4_blocks(&[1.0; 31], Fp4Floor::AmaxFloor).is_err());
    let mut bad = [0.0f32; 32];
    bad[3] = f32::NAN;
    assert!(matches!(
        quantize_fp4_blocks(&bad, Fp4Floor::AmaxFloor),
        Err(dsa_indexer::Error::BadFloat { index: 3, .. })
    ));
}

#[test]
fn fp8_row_quantizer() {
    let x: Vec<f32> = (0..128).map(|i| (i as f32 - 64.0) * 0.37).collect();
    let (codes, scale) = quantize_fp8_rows(&x, Fp8Scale::Exact).unwrap();
    assert_eq!(scale, 64.0f32 * 0.37 / 448.0);
    assert_eq!(codes[0], 0xFE, "-amax maps to -448");
    let (_, s2) = quantize_fp8_rows(&x, Fp8Scale::PowerOfTwo).unwrap();
    assert!(
        s2 >= scale && s2.to_bits() & 0x7F_FFFF == 0,
        "power of two at least the exact scale"
    );
    let (c0, s0) = quantize_fp8_rows(&[0.0; 128], Fp8Scale::Exact).unwrap();
    assert_eq!(s0, 1e-4f32 / 448.0);
    assert!(c0.iter().all(|&c| c == 0));
    assert!(quantize_fp8_rows(&[f32::INFINITY], Fp8Scale::Exact).is_err());
}
