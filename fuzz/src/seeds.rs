//! The committed seeds of the targets that do not decode a [`crate::case::Spec`]
//! (`topk`, `codecs`, `batch_layout`, `verdict`), and the test that writes every target's seeds.

/// `topk`: `n` around `K` and `B * NB`, every score mode, ties, the special values.
fn topk_seeds() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    // n around K and around B * NB = 3 * 4, every score mode, all-ties rows.
    for n in [0usize, 1, 2, 11, 12, 13, 40] {
        for (kname, k) in [
            ("km1", n.saturating_sub(2)),
            ("k", n.saturating_sub(1)),
            ("kp1", n),
        ] {
            for mode in 0u8..4 {
                let mut b = vec![k as u8, 2, 3, mode, 0b1011_0101, 0, 0, 0x80];
                for j in 0..n as u32 {
                    let w = match mode {
                        0 => (j.wrapping_mul(0x9E37_79B9) >> 7) | 0x3F00_0000,
                        _ => j.wrapping_mul(7) % 32,
                    };
                    b.extend(w.to_le_bytes());
                }
                out.push((format!("n{n}_{kname}_mode{mode}"), b));
            }
        }
    }
    // Every special value, in order, then reversed.
    let mut b = vec![5, 0, 7, 1, 0xFF, 0xFF, 0xFF, 0xFF];
    (0u32..16)
        .chain((0..16).rev())
        .for_each(|w| b.extend(w.to_le_bytes()));
    out.push(("specials".into(), b));
    out
}

/// `codecs`: rounding boundaries and special values, and the golden quantizer rows.
fn codecs_seeds() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let specials: [f32; 18] = [
        448.0,
        464.0,
        480.0,
        -464.0,
        -0.0,
        2f32.powi(-10),
        -2f32.powi(-10),
        2.5,
        5.0,
        0.25,
        0.75,
        -0.25,
        6.0,
        7.0,
        f32::NAN,
        f32::INFINITY,
        f32::from_bits(0x0040_0000),
        f32::from_bits(1),
    ];
    for (i, &x) in specials.iter().enumerate() {
        let mut b = vec![i as u8 * 15, i as u8, i as u8 * 14, i as u8 % 4];
        b.extend(x.to_le_bytes());
        out.push((format!("scalar_{i:02}"), b));
    }
    // The golden quantizer rows (tests/golden/quantizers.safetensors, x F32 [rows, 128]).
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/golden/quantizers.safetensors");
    let buf = std::fs::read(&path).expect("golden quantizers");
    let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
    let x = st.tensor("x").unwrap();
    for (r, row) in x.data().chunks(128 * 4).enumerate() {
        let mut b = vec![0x7E, 0x8, 0, r as u8 % 4];
        b.extend(1e-4f32.to_le_bytes());
        b.extend(row);
        out.push((format!("golden_quantizers_row{r:02}"), b));
    }
    out
}

/// `batch_layout`: SPEC 3's worked example, and sizes that overflow `usize`.
fn batch_seeds() -> Vec<(String, Vec<u8>)> {
    let rec = |s: u64, second: u64| [s.to_le_bytes(), second.to_le_bytes()].concat();
    let small = |v: u64| v; // top bits 00: v % 64
    let huge = |v: u64| (1u64 << 62) | v; // usize::MAX - v % 64
    let mut out = Vec::new();
    // SPEC 3's worked example, ratios 1 and 2, contiguous and explicit.
    for (name, class, r) in [("r1", 1u8, 0u64), ("r2", 8, 1)] {
        let mut b = vec![0u8, class];
        b.extend(r.to_le_bytes());
        b.extend(rec(small(10), 7));
        b.extend(rec(small(4), 2));
        out.push((format!("spec3_{name}"), b.clone()));
        b[0] = 1;
        out.push((format!("spec3_explicit_{name}"), b));
    }
    // L overflows usize; T overflows usize; one request of usize::MAX tokens, no rows.
    for (name, recs) in [
        (
            "keys_overflow",
            vec![rec(huge(0), huge(0)), rec(huge(0), huge(0))],
        ),
        ("rows_overflow", vec![rec(huge(0), 0), rec(huge(1), 0)]),
        (
            "max_no_rows",
            vec![rec(huge(0), 2 << 10), rec(small(3), 1 << 10)],
        ),
    ] {
        let mut b = vec![0u8, 1, 0, 0, 0, 0, 0, 0, 0, 0];
        recs.iter().for_each(|r| b.extend(r));
        out.push((name.into(), b));
    }
    out
}

/// `verdict`: every format pair, with and without engine logits, every tolerance, and
/// one to three mutations of each kind, on random shapes and palettes.
fn verdict_seeds() -> Vec<(String, Vec<u8>)> {
    let mut rng = crate::Rng(17);
    let mut out = Vec::new();
    for fmt in 0u8..4 {
        for engine in 0u8..3 {
            for tol in 0u8..4 {
                for kind in 0u8..6 {
                    if rng.below(3) != 0 {
                        continue;
                    }
                    let mut b = vec![fmt, rng.below(2) as u8];
                    b.extend((0..3).map(|_| rng.next() as u8));
                    b.push([0, 2, 3, 4, 8][rng.below(5)]);
                    b.extend((0..8).map(|_| rng.next() as u8));
                    b.extend(rng.next().to_le_bytes());
                    b.extend([
                        engine,
                        [0, 8, 10, 12, 14][rng.below(5)],
                        tol,
                        rng.next() as u8,
                    ]);
                    for _ in 0..1 + rng.below(3) {
                        let k = if rng.below(10) < 7 {
                            kind
                        } else {
                            rng.below(6) as u8
                        };
                        b.extend([rng.next() as u8, k, rng.next() as u8, rng.next() as u8]);
                    }
                    out.push((format!("f{fmt}_e{engine}_t{tol}_k{kind}"), b));
                }
            }
        }
    }
    out
}

/// `WRITE_SEEDS=1 cargo test --manifest-path fuzz/Cargo.toml` rewrites the committed
/// seeds (`corpus/<target>/seed_*`) of every target but `dump_parse`, whose seeds
/// are the golden files (`dump_struct`'s are the layers of `chunked_vs_reference`'s).
#[test]
fn write_seeds() {
    if std::env::var_os("WRITE_SEEDS").is_none() {
        return;
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let spec: Vec<(String, Vec<u8>)> = crate::case::seeds()
        .into_iter()
        .map(|(n, s)| (n, s.to_bytes()))
        .collect();
    // dump_struct: the same layers, unmutated (the bytes after a spec read as zeros:
    // no breaking mutation, no kept one).
    let dump_struct = spec.clone();
    for (target, files) in [
        ("dump_struct", dump_struct),
        ("chunked_vs_reference", spec.clone()),
        ("cuda_vs_reference", spec),
        ("topk", topk_seeds()),
        ("codecs", codecs_seeds()),
        ("batch_layout", batch_seeds()),
        ("verdict", verdict_seeds()),
    ] {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in files {
            std::fs::write(dir.join(format!("seed_{name}")), bytes).unwrap();
        }
    }
}
