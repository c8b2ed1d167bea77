//! SPEC 2's codecs and quantizers on arbitrary bytes and floats, against a brute-force
//! nearest-value encoder written here, and against the `float8` (E4M3) and `float4`
//! (E2M1, E8M0, MXFP4 blocks) crates where SPEC 2 and those crates agree.
//!
//! Documented differences, not asserted (see fuzz/FINDINGS.md):
//! - a negative value that rounds to zero: SPEC 2 encodes `+0`; both crates keep the
//!   sign (`0x80`, `0x8`);
//! - NaN and infinite inputs: SPEC 2 is an error; `float8` gives NaN (`0x7F`) or
//!   saturates infinities, `float4` saturates (NaN to `+6`);
//! - `E8M0::from_f64(x)` for `x <= 2^-127` gives byte 0; SPEC 2's quantizers clamp the
//!   scale byte to `[1, 254]`. Byte 0 decodes to `2^-127` in both (unlike DeepGEMM).
//!
//! Input: 8 header bytes `[e4m3 byte, e2m1 nibble, ue8m0 byte, flags, x (4 bytes LE)]`,
//! then a row of little-endian f32 for the quantizers.
#![no_main]

use dsa_indexer::formats::{e2m1, e4m3, ue8m0, Fp4Floor, Fp8Scale};
use dsa_indexer::formats::{quantize_fp4_blocks, quantize_fp8_rows};
use float4::{MXFP4Block, E8M0, F4E2M1};
use float8::F8E4M3;
use fuzz_common::STATS;
use libfuzzer_sys::fuzz_target;

/// Round to nearest among `values` (finite, one per code), ties to the even code
/// (the one whose lowest bit is 0: the even mantissa), saturating at the ends.
/// `x >= 0`. (Distances to the grid are exact in f64 where they decide anything:
/// near a midpoint `x` and the grid values are of one magnitude.)
fn nearest(x: f32, codes: impl Iterator<Item = (u8, f32)> + Clone) -> u8 {
    let (max_code, max) = codes
        .clone()
        .fold((0u8, 0f32), |a, (c, v)| if v > a.1 { (c, v) } else { a });
    if x >= max {
        return max_code;
    }
    let x = x as f64;
    let mut best: Option<(f64, u8)> = None;
    for (c, v) in codes {
        let d = (v as f64 - x).abs();
        best = match best {
            Some((bd, bc)) if bd < d || (bd == d && bc & 1 == 0) => Some((bd, bc)),
            _ => Some((d, c)),
        };
    }
    best.unwrap().1
}

/// SPEC 2's E4M3 encoder: nearest finite value, ties to even, `+0` for zero.
fn e4m3_spec(x: f32) -> u8 {
    let sign = if x < 0.0 { 0x80 } else { 0 };
    let c = nearest(x.abs(), (0u8..0x7F).map(|c| (c, e4m3::TABLE[c as usize])));
    if c == 0 {
        0
    } else {
        c | sign
    }
}

/// SPEC 2's E2M1 encoder.
fn e2m1_spec(x: f32) -> u8 {
    let sign = if x < 0.0 { 0x8 } else { 0 };
    let c = nearest(x.abs(), (0u8..8).map(|c| (c, e2m1::TABLE[c as usize])));
    if c == 0 {
        0
    } else {
        c | sign
    }
}

/// The byte of the smallest power of two `>= x` (positive finite `x`), clamped to `[1, 254]`.
fn ue8m0_ceil_spec(x: f32) -> u8 {
    (1u8..=254)
        .find(|&e| ue8m0::TABLE[e as usize] >= x)
        .unwrap_or(254)
}

/// The crates keep the sign of a zero result; SPEC 2 encodes `+0`.
fn plus_zero(code: u8, zero_mask: u8, sign: u8) -> u8 {
    if code & zero_mask == 0 {
        code & !sign
    } else {
        code
    }
}

fn check_scalar(b: u8, nib: u8, e: u8, x: f32) {
    // E4M3 decode: every byte, bit for bit with float8 (NaN codes: both NaN).
    let d = e4m3::decode(b);
    let f8 = F8E4M3::from_bits(b).to_f32();
    assert!(
        d.to_bits() == f8.to_bits() || (d.is_nan() && f8.is_nan()),
        "e4m3 decode {b:#04x}: {d:e} vs float8 {f8:e}"
    );
    assert_eq!(e4m3::is_nan_code(b), d.is_nan(), "e4m3 NaN code {b:#04x}");
    if !d.is_nan() {
        let back = e4m3::encode(d).expect("finite");
        assert_eq!(
            back,
            if b == 0x80 { 0 } else { b },
            "e4m3 round trip {b:#04x}"
        );
    }
    // E2M1 decode and round trip.
    let n = nib & 0xF;
    let d = e2m1::decode(n);
    let f4 = F4E2M1::from_bits(n).to_f64() as f32;
    assert_eq!(
        d.to_bits(),
        f4.to_bits(),
        "e2m1 decode {n:#x}: {d:e} vs float4 {f4:e}"
    );
    assert_eq!(
        e2m1::encode(d).expect("finite"),
        if n == 0x8 { 0 } else { n },
        "e2m1 round trip {n:#x}"
    );
    // UE8M0 decode: byte 0 is 2^-127 (f32 bits 0x00400000) in SPEC 2 and float4.
    let d = ue8m0::decode(e);
    let f = E8M0::from_bits(e).to_f64() as f32;
    assert!(
        d.to_bits() == f.to_bits() || (e == 255 && d.is_nan() && f.is_nan()),
        "ue8m0 decode {e}: {d:e} vs float4 {f:e}"
    );
    if e < 255 {
        assert_eq!(
            d.to_bits(),
            (e as u32) << 23 | if e == 0 { 0x40_0000 } else { 0 }
        );
    }

    // Encoders on an arbitrary f32.
    match e4m3::encode(x) {
        Err(_) => assert!(!x.is_finite(), "e4m3 encode rejected finite {x:e}"),
        Ok(c) => {
            assert!(x.is_finite(), "e4m3 encode accepted {x:e}");
            assert_eq!(c, e4m3_spec(x), "e4m3 encode {x:e} ({:#010x})", x.to_bits());
            let f8 = plus_zero(F8E4M3::from_f32(x).to_bits(), 0x7F, 0x80);
            assert_eq!(c, f8, "e4m3 encode {x:e} vs float8");
        }
    }
    match e2m1::encode(x) {
        Err(_) => assert!(!x.is_finite(), "e2m1 encode rejected finite {x:e}"),
        Ok(c) => {
            assert!(x.is_finite(), "e2m1 encode accepted {x:e}");
            assert_eq!(c, e2m1_spec(x), "e2m1 encode {x:e} ({:#010x})", x.to_bits());
            let f4 = plus_zero(F4E2M1::from_f64(x as f64).to_bits(), 0x7, 0x8);
            assert_eq!(c, f4, "e2m1 encode {x:e} vs float4");
        }
    }
    if x.is_finite() && x > 0.0 {
        let c = ue8m0::encode_ceil(x);
        assert_eq!(c, ue8m0_ceil_spec(x), "ue8m0 ceil {x:e}");
        if x > ue8m0::TABLE[0] {
            assert_eq!(
                c,
                E8M0::from_f64(x as f64).to_bits(),
                "ue8m0 ceil {x:e} vs float4"
            );
        }
    }
}

fn check_quantizers(xs: &[f32], flags: u8) {
    let finite = xs.iter().all(|v| v.is_finite());
    let floor = if flags & 1 == 0 {
        Fp4Floor::AmaxFloor
    } else {
        Fp4Floor::ScaleFloor
    };
    match quantize_fp4_blocks(xs, floor) {
        Err(_) => assert!(
            xs.is_empty() || !xs.len().is_multiple_of(32) || !finite,
            "fp4 quantizer rejected a valid row"
        ),
        Ok((packed, scales)) => {
            assert!(!xs.is_empty() && xs.len().is_multiple_of(32) && finite);
            assert_eq!((packed.len(), scales.len()), (xs.len() / 2, xs.len() / 32));
            for (g, grp) in xs.chunks(32).enumerate() {
                let amax = grp.iter().fold(0f32, |a, v| a.max(v.abs()));
                let s = match floor {
                    Fp4Floor::AmaxFloor => amax.max(1e-4) / 6.0,
                    Fp4Floor::ScaleFloor => (amax / 6.0).max(1e-4),
                };
                let e = ue8m0_ceil_spec(s);
                assert_eq!(scales[g], e, "fp4 block {g} scale byte");
                assert_eq!(E8M0::from_f64(s as f64).to_bits(), e, "scale vs float4");
                let scale = ue8m0::TABLE[e as usize];
                let mut f4 = [F4E2M1::from_bits(0); 32];
                for (i, &v) in grp.iter().enumerate() {
                    let q = v / scale;
                    let c = e2m1::unpack(&packed, g * 32 + i);
                    assert_eq!(
                        c,
                        e2m1_spec(q),
                        "fp4 element {}: {v:e} / {scale:e}",
                        g * 32 + i
                    );
                    assert_eq!(c, plus_zero(F4E2M1::from_f64(q as f64).to_bits(), 0x7, 0x8));
                    f4[i] = F4E2M1::from_bits(c);
                }
                // MXFP4 block semantics: code * 2^(e-127), element 2i in the low nibble.
                let block = MXFP4Block::from_f32_slice(f4, E8M0::from_bits(e)).to_f32_array();
                for (i, &v) in block.iter().enumerate() {
                    let c = e2m1::unpack(&packed[g * 16..g * 16 + 16], i);
                    let ours = (e2m1::decode(c) as f64 * scale as f64) as f32;
                    assert_eq!(v.to_bits(), ours.to_bits(), "MXFP4 element {i}");
                }
            }
        }
    }
    let mode = if flags & 2 == 0 {
        Fp8Scale::Exact
    } else {
        Fp8Scale::PowerOfTwo
    };
    match quantize_fp8_rows(xs, mode) {
        Err(_) => assert!(!finite, "fp8 quantizer rejected a finite row"),
        Ok((codes, scale)) => {
            assert!(finite);
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            let mut want = amax.max(1e-4) / 448.0;
            if mode == Fp8Scale::PowerOfTwo {
                want = ue8m0::TABLE[ue8m0_ceil_spec(want) as usize];
            }
            assert_eq!(
                scale.to_bits(),
                want.to_bits(),
                "fp8 scale of amax {amax:e}"
            );
            for (i, (&c, &v)) in codes.iter().zip(xs).enumerate() {
                let q = v / scale;
                assert_eq!(c, e4m3_spec(q), "fp8 element {i}: {v:e} / {scale:e}");
                assert_eq!(c, plus_zero(F8E4M3::from_f32(q).to_bits(), 0x7F, 0x80));
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    STATS.input("codecs");
    let mut h = [0u8; 8];
    let n = data.len().min(8);
    h[..n].copy_from_slice(&data[..n]);
    let x = f32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    check_scalar(h[0], h[1], h[2], x);
    let xs: Vec<f32> = data[n..]
        .chunks_exact(4)
        .take(256)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    check_quantizers(&xs, h[3]);
    STATS.reached();
});
