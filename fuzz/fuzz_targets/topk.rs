//! SPEC 5 and 6 on arbitrary score rows: the ranking key, the top-k selection (plain
//! and restricted to consumer blocks) and the kept candidate blocks, each against a
//! naive full sort written here from the SPEC's words (NaN as -inf, -0.0 as +0.0,
//! score descending then index ascending), not from the crate's `rank_key`.
//!
//! Input: 8 header bytes `[k, block_size, num_blocks, mode, mask (4 bytes LE)]`, then
//! the scores as little-endian u32 words, mapped by `mode % 4`: raw bits; one of 16
//! special values; small integers (heavy ties); or a mix.
#![no_main]

use std::cell::RefCell;
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use dsa_indexer::reference::candidates::{block_keys, consumer_candidates, kept_blocks};
use dsa_indexer::reference::topk::{rank_key, select, select_by_sort, Scratch};
use fuzz_common::STATS;
use libfuzzer_sys::fuzz_target;

const SPECIAL: [u32; 16] = [
    0x7FC0_0000, // NaN
    0xFFC0_0000, // -NaN
    0x7F80_0001, // signalling NaN payload
    0x0000_0000, // +0
    0x8000_0000, // -0
    0x7F80_0000, // +inf
    0xFF80_0000, // -inf
    0x0000_0001, // smallest subnormal
    0x8000_0001, // its negative
    0x7F7F_FFFF, // f32::MAX
    0xFF7F_FFFF, // f32::MIN
    0x3F80_0000, // 1
    0x3F80_0001, // 1 + ulp
    0xBF80_0000, // -1
    0x0080_0000, // smallest normal
    0x4380_0000, // 256
];

fn score(word: u32, mode: u8) -> f32 {
    match mode % 4 {
        0 => f32::from_bits(word),
        1 => f32::from_bits(SPECIAL[(word % 16) as usize]),
        2 => ((word % 5) as f32 - 2.0) * if word & 0x100 != 0 { 1.0 } else { 0.5 },
        _ => {
            if word & 1 == 0 {
                f32::from_bits(SPECIAL[((word >> 1) % 16) as usize])
            } else {
                ((word >> 1) % 3) as f32
            }
        }
    }
}

/// SPEC 5's ranking key, as a number: NaN is -inf, -0.0 is +0.0.
fn key(x: f32) -> f64 {
    if x.is_nan() {
        f64::NEG_INFINITY
    } else if x == 0.0 {
        0.0
    } else {
        x as f64
    }
}

/// Better first: key descending, then index ascending.
fn better(a: (f64, usize), b: (f64, usize)) -> Ordering {
    b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1))
}

fn naive_select(scores: &[f32], cands: &[usize], k: usize) -> Vec<i32> {
    let mut c: Vec<(f64, usize)> = cands.iter().map(|&j| (key(scores[j]), j)).collect();
    c.sort_by(|&a, &b| better(a, b));
    let mut ids: Vec<i32> = c.iter().take(k).map(|&(_, j)| j as i32).collect();
    ids.sort_unstable();
    ids
}

/// SPEC 6's kept blocks of a row with `n > 0`, `-1`-padded to `nb_keep`.
fn naive_kept(scores: &[f32], n: usize, b: usize, nb_keep: usize) -> Vec<i32> {
    let nb = n.div_ceil(b);
    let block = |c: usize| {
        (c * b..((c + 1) * b).min(n))
            .map(|j| key(scores[j]))
            .fold(f64::NEG_INFINITY, f64::max)
    };
    let pinned = (n - 1) / b;
    let mut others: Vec<(f64, usize)> = (0..nb)
        .filter(|&c| c != pinned)
        .map(|c| (block(c), c))
        .collect();
    others.sort_by(|&x, &y| better(x, y));
    let mut ids: Vec<i32> = std::iter::once(pinned)
        .chain(others.iter().map(|&(_, c)| c))
        .take(nb_keep.min(nb))
        .map(|c| c as i32)
        .collect();
    ids.sort_unstable();
    ids.resize(nb_keep, -1);
    ids
}

thread_local! {
    // Reused across inputs with different K and NB, as workers reuse them across rows.
    static SCRATCH: RefCell<(Scratch, BinaryHeap<Reverse<u64>>)> =
        RefCell::new((Scratch::new(1), BinaryHeap::new()));
}

fuzz_target!(|data: &[u8]| {
    STATS.input("topk");
    if data.len() < 8 {
        STATS.note("short");
        return;
    }
    let (h, rest) = data.split_at(8);
    let mode = h[3];
    let mask = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    let scores: Vec<f32> = rest
        .chunks(4)
        .take(512)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            score(u32::from_le_bytes(w), mode)
        })
        .collect();
    let n = scores.len();
    let k = 1 + h[0] as usize % (n + 3);
    let b = 1 + h[1] as usize % 9;
    let nb_keep = 1 + h[2] as usize % 8;

    // The ranking key is SPEC 5's total order.
    for w in scores.windows(2) {
        let (x, y) = (w[0], w[1]);
        assert_eq!(
            rank_key(x).cmp(&rank_key(y)),
            key(x).partial_cmp(&key(y)).unwrap(),
            "rank_key order of {x:e} ({:#010x}) and {y:e} ({:#010x})",
            x.to_bits(),
            y.to_bits()
        );
    }

    SCRATCH.with(|s| {
        let (scratch, heap) = &mut *s.borrow_mut();
        // Plain rows: every visible key is a candidate.
        let all: Vec<usize> = (0..n).collect();
        let want = naive_select(&scores, &all, k);
        assert_eq!(
            select(&scores, 0..n, k, scratch),
            &want[..],
            "select, K = {k}"
        );
        assert_eq!(select_by_sort(&scores, &all, k), want, "select_by_sort");

        // Consumer rows: keys in the kept blocks (ascending ids from the mask, padded).
        let nb = n.div_ceil(b);
        let mut blocks: Vec<i32> = (0..nb.min(32))
            .filter(|c| mask >> c & 1 == 1)
            .map(|c| c as i32)
            .collect();
        blocks.resize(blocks.len() + (h[2] % 3) as usize, -1);
        let cands: Vec<usize> = (0..n)
            .filter(|&j| blocks.contains(&((j / b) as i32)))
            .collect();
        let got: Vec<usize> = consumer_candidates(&blocks, n, b).collect();
        assert_eq!(got, cands, "consumer candidates of blocks {blocks:?}");
        let want = naive_select(&scores, &cands, k);
        assert_eq!(
            select(&scores, consumer_candidates(&blocks, n, b), k, scratch),
            &want[..],
            "consumer select, K = {k}, blocks {blocks:?}"
        );

        // Source rows: block scores and kept blocks, every prefix length of the row.
        for m in [n, n / 2, 1] {
            if m == 0 || m > n {
                continue;
            }
            let mut keys = vec![0u32; m.div_ceil(b)];
            block_keys(&scores[..m], m, b, &mut keys);
            for (c, &bk) in keys.iter().enumerate() {
                let best = scores[c * b..((c + 1) * b).min(m)]
                    .iter()
                    .map(|&x| rank_key(x))
                    .max()
                    .unwrap();
                assert_eq!(bk, best, "block {c} score");
            }
            let mut out = vec![7i32; nb_keep];
            kept_blocks(&keys, m, b, &mut out, heap);
            assert_eq!(
                out,
                naive_kept(&scores, m, b, nb_keep),
                "kept blocks, n = {m}, B = {b}, NB = {nb_keep}"
            );
        }
    });
    STATS.reached();
});
