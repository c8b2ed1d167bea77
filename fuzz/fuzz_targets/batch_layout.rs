//! SPEC 3 and 7 on arbitrary request lists, including absurd sizes whose sums and
//! products overflow: `Batch::contiguous`, `Batch::explicit`, `Batch::tail` and the
//! planner give a layout consistent with an independent u128 model, or a typed error
//! exactly when the model says the input is invalid or too large. `reached` counts
//! accepted batches; every rejection is also checked against the model.
//!
//! Input: header `[mode, ratio class, ratio (8 bytes)]`, then 16-byte records
//! `(seq_len, second)` of u64 size selectors. Contiguous: `second` selects `query_start`.
//! Explicit: `second` selects `(request, position)`. A selector's top two bits pick small
//! (`v % 64`), near `usize::MAX`, a power of two +-1, or the raw value.
#![no_main]

use dsa_indexer::batch::Batch;
use dsa_indexer::indexer::RowFootprint;
use dsa_indexer::plan::{plan, PlanParams, PlanRole};
use fuzz_common::{kind, STATS};
use libfuzzer_sys::fuzz_target;

/// Rows the target materialises; larger valid batches are skipped (they allocate).
const MAX_ROWS: u128 = 1 << 14;

fn size(v: u64) -> usize {
    let low = v & 0x3FFF_FFFF_FFFF_FFFF;
    match v >> 62 {
        0 => (low % 64) as usize,
        1 => usize::MAX - (low % 64) as usize,
        2 => (1usize << (low % 64))
            .wrapping_add((low >> 6) as usize % 3)
            .wrapping_sub(1),
        _ => low as usize,
    }
}

fn u64s(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w[..b.len().min(8)].copy_from_slice(&b[..b.len().min(8)]);
    u64::from_le_bytes(w)
}

fn check_batch(b: &Batch, seq_lens: &[usize], rows: &[(usize, usize)], ratio: usize) {
    fuzz_common::case::check_layout(b);
    assert_eq!(b.seq_lens(), seq_lens, "seq_lens");
    let got: Vec<(usize, usize)> = b.rows().iter().map(|r| (r.request, r.position)).collect();
    assert_eq!(got, rows, "rows");
    let l: u128 = seq_lens.iter().map(|&s| (s / ratio) as u128).sum();
    assert_eq!(b.num_keys() as u128, l, "L");
    let pairs: u128 = rows
        .iter()
        .map(|&(_, p)| (p as u128 + 1) / ratio as u128)
        .sum();
    assert_eq!(
        b.valid_pairs() as u128,
        pairs.min(usize::MAX as u128),
        "valid pairs"
    );
}

fuzz_target!(|data: &[u8]| {
    STATS.input("batch_layout");
    if data.len() < 2 {
        STATS.note("short");
        return;
    }
    let mode = data[0];
    let ratio = match data[1] % 16 {
        0 => 0,
        1..=7 => 1,
        8..=13 => 1 + (u64s(&data[2..]) % 8) as usize,
        _ => size(u64s(&data[2..])),
    };
    let recs: Vec<(usize, u64)> = data
        .get(10..)
        .unwrap_or(&[])
        .chunks(16)
        .take(64)
        .map(|c| (size(u64s(c)), u64s(c.get(8..).unwrap_or(&[]))))
        .collect();
    let seq_lens: Vec<usize> = recs.iter().map(|r| r.0).collect();
    // The model: L = sum S_b / r must fit usize.
    let l: Option<u128> = (ratio > 0).then(|| seq_lens.iter().map(|&s| (s / ratio) as u128).sum());
    let keys_ok = l.is_some_and(|l| l <= usize::MAX as u128);

    let (result, rows, expect_ok) = if mode.is_multiple_of(2) {
        // Contiguous.
        let q0: Vec<usize> = recs
            .iter()
            .map(|&(s, v)| match (v >> 10) & 3 {
                0 => size(v),
                1 => size(v) % s.saturating_add(1).max(1),
                _ => s - (size(v) % 64).min(s),
            })
            .collect();
        let starts_ok = seq_lens.iter().zip(&q0).all(|(&s, &q)| q <= s);
        let t: u128 = seq_lens
            .iter()
            .zip(&q0)
            .map(|(&s, &q)| s.saturating_sub(q) as u128)
            .sum();
        let valid = ratio > 0 && keys_ok && starts_ok;
        if valid && t > MAX_ROWS && t <= usize::MAX as u128 / 32 {
            // Valid and allocatable in principle, too large to materialise here.
            STATS.note("skipped:large");
            return;
        }
        let rows: Vec<(usize, usize)> = if valid && t <= MAX_ROWS {
            seq_lens
                .iter()
                .zip(&q0)
                .enumerate()
                .flat_map(|(b, (&s, &q))| (q..s).map(move |p| (b, p)))
                .collect()
        } else {
            Vec::new()
        };
        let r = Batch::contiguous(&seq_lens, &q0, ratio);
        if let Ok(b) = &r {
            assert!(
                valid && t <= MAX_ROWS,
                "accepted: ratio {ratio}, {seq_lens:?}, {q0:?}"
            );
            assert_eq!(b.query_starts(), Some(&q0[..]), "query_starts");
        }
        (r, rows, valid && t <= MAX_ROWS)
    } else {
        // Explicit: records give (request, position) too.
        let rows: Vec<(usize, usize)> = recs
            .iter()
            .map(|&(_, v)| {
                let n = seq_lens.len();
                let b = if n == 0 || (v >> 10) % 16 == 0 {
                    n + (v % 3) as usize
                } else {
                    (v % n as u64) as usize
                };
                let raw = size(v.rotate_left(17));
                let p = match seq_lens.get(b) {
                    Some(&s) if s > 0 && v & 0x300 != 0 => raw % s,
                    _ => raw,
                };
                (b, p)
            })
            .collect();
        let valid = ratio > 0
            && keys_ok
            && rows
                .iter()
                .all(|&(b, p)| b < seq_lens.len() && p < seq_lens[b]);
        let (reqs, pos): (Vec<usize>, Vec<usize>) = rows.iter().copied().unzip();
        let r = Batch::explicit(&seq_lens, &reqs, &pos, ratio);
        if r.is_ok() {
            assert!(valid, "accepted: ratio {ratio}, {seq_lens:?}, {rows:?}");
        }
        (r, rows, valid)
    };
    let batch = match result {
        Ok(b) => b,
        Err(e) => {
            assert!(
                !expect_ok,
                "valid batch rejected: {e} (ratio {ratio}, {seq_lens:?})"
            );
            STATS.note(format!("rejected:{}", kind(&e)));
            return;
        }
    };
    check_batch(&batch, &seq_lens, &rows, ratio);

    // Tail batches (SPEC 6): rows at positions >= S_b - tail, in order.
    let tail = 1 + size(u64s(data.get(2..).unwrap_or(&[]))).min(usize::MAX - 1);
    assert!(batch.tail(0).is_err(), "tail 0 accepted");
    let tb = batch.tail(tail).expect("tail >= 1");
    let trows: Vec<(usize, usize)> = rows
        .iter()
        .copied()
        .filter(|&(b, p)| p as u128 + tail as u128 >= seq_lens[b] as u128)
        .collect();
    check_batch(&tb, &seq_lens, &trows, ratio);
    if let Some(q0) = batch.query_starts() {
        let q1: Vec<usize> = q0
            .iter()
            .zip(&seq_lens)
            .map(|(&q, &s)| q.max(s.saturating_sub(tail)))
            .collect();
        assert_eq!(tb.query_starts(), Some(&q1[..]), "tail query_starts");
        let again = Batch::contiguous(&seq_lens, &q1, ratio).expect("the tail batch is valid");
        assert_eq!(again.rows(), tb.rows(), "tail vs contiguous(q0')");
    }

    // The planner: tiles in order, each within the budget or a single oversized row.
    let budget = size(u64s(data.get(10..).unwrap_or(&[])).rotate_left(29)).max(1);
    let fp = RowFootprint {
        align: 1 + (mode as usize >> 1) % 8,
        workers: 1 + (mode as usize >> 4),
        worker_bytes: 0,
        logits_slots: 1 + (mode as usize >> 6) % 2,
    };
    let params = PlanParams {
        heads: 8,
        dim: 32,
        topk: 1 + (mode as usize >> 2),
        block_size: 1 + (mode as usize) % 9,
        num_blocks: 1 + (mode as usize) % 5,
        role: match mode % 3 {
            0 => PlanRole::Plain,
            1 => PlanRole::Source { tail: Some(tail) },
            _ => PlanRole::Source { tail: None },
        },
        budget,
    };
    let p = plan(&batch, &params, &fp).expect("a valid plan");
    let mut next = 0;
    for t in &p.tiles {
        assert_eq!(t.rows.start, next, "tiles in order");
        next = t.rows.end;
        let bytes = t.rows.clone().fold(0usize, |a, i| {
            a.saturating_add(dsa_indexer::plan::Footprint::row_bytes(
                &fp,
                batch.rows()[i].n,
            ))
        });
        assert_eq!(t.logits_bytes, bytes, "tile bytes");
        assert!(
            t.logits_bytes <= budget || (t.rows.len() == 1 && t.oversized),
            "tile over budget"
        );
    }
    assert_eq!(next, batch.num_rows(), "tiles cover the rows");
    // Two slots: both in flight within the budget, or one slot as the planner's rule says.
    let max_tile = p.tiles.iter().map(|t| t.logits_bytes).max().unwrap_or(0);
    assert_eq!(
        p.peak.logits_tile,
        max_tile.saturating_mul(p.logits_slots),
        "slots x the largest tile"
    );
    if p.logits_slots == 2 {
        assert_eq!(fp.logits_slots, 2, "two slots asked for");
        assert!(p.tiles.len() >= 2, "two slots for one tile");
        assert!(p.peak.logits_tile <= budget, "two slots over budget");
    } else {
        assert_eq!(p.logits_slots, 1, "slots");
    }
    let bad = PlanParams {
        budget: 0,
        ..params
    };
    assert!(plan(&batch, &bad, &fp).is_err(), "budget 0 accepted");
    STATS.reached();
});
