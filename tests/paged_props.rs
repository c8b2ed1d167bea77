//! SPEC 10's invariant on random problems: a problem over paged keys and the same
//! problem with its keys flat give bitwise the same `raw`, logits and published blocks,
//! and `page` reports the pool slot of each selected key. Every format pair, every role
//! (plain, source with a tail, consumer), both row layouts and decode batches (`q0_b =
//! S_b - next_n`, `next_n` in 1..=4); random page sizes, page ids in random order with
//! holes, shared prefixes and garbage in everything no request reads
//! (`common::paging`). Held on the reference, on the chunked driver at several budgets
//! (budget invariance for paged keys) and on the fast engine for every instruction set.
//!
//! Heavier sweeps: `PROPTEST_CASES=2000 cargo test --release --test paged_props`.

mod common;

use common::paging::{self, Paged};
use common::strategies::{build, shape, shape_with, Shape};
use common::{bits, first_diff};
use dsa_indexer::cpu::{engine_logits, Isa};
use dsa_indexer::dump::{Dump, KData, Layout};
use dsa_indexer::indexer::run_cpu;
use dsa_indexer::reference;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Lay `d` out paged from `seed` (page size from the seed, or `page_size`).
fn paged_from(d: &Dump, seed: u64, page_size: Option<usize>) -> Paged {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    paging::page(d, page_size, &mut |n| rng.gen_range(0..n))
}

/// Every claim of SPEC 10 about the two layouts of one problem, on every CPU path.
fn check(pg: &Paged, budget: usize) -> Result<(), TestCaseError> {
    let batch = pg.flat.batch().unwrap();
    let published = pg.flat.published_input(&batch);
    let fp = pg.flat.problem(&batch, published.as_ref()).unwrap();
    let pp = pg
        .paged
        .problem(&batch, published.as_ref())
        .map_err(|e| TestCaseError::fail(format!("paged problem rejected: {e}")))?;
    prop_assert!(pp.paged().is_some() && fp.paged().is_none());

    // The library's gather: the flat keys and the pool slots.
    let g = pp.gather_keys().unwrap();
    prop_assert_eq!(&g.slots, &pg.slots, "gathered pool slots");
    let same_keys = match &pg.flat.k {
        KData::E4m3 { codes, scale } => {
            g.codes == *codes
                && first_diff(
                    &bits(g.e4m3_scale.as_slice().unwrap()),
                    &bits(scale.as_slice().unwrap()),
                )
                .is_none()
        }
        KData::E2m1 { packed, scale } => g.codes == *packed && g.e2m1_scale == *scale,
        KData::Paged { .. } => false,
    };
    prop_assert!(same_keys, "gathered keys differ from the flat keys");

    // Reference: logits, raw, page, published.
    let want_logits = bits(&reference::logits(&fp));
    let got_logits = bits(&reference::logits(&pp));
    if let Some(i) = first_diff(&got_logits, &want_logits) {
        return Err(TestCaseError::fail(format!(
            "reference logits differ at {i}: paged {:?}, flat {:?}",
            got_logits.get(i).map(|b| f32::from_bits(*b)),
            want_logits.get(i).map(|b| f32::from_bits(*b))
        )));
    }
    let want = reference::run(&fp);
    let got = reference::run(&pp);
    prop_assert_eq!(&got, &want, "reference outputs, paged vs flat");
    let gathered = reference::run(&pp.with_flat_keys(&g));
    prop_assert_eq!(&gathered, &want, "reference outputs over the gathered keys");

    // page[i, c] is the pool slot of raw[i, c]; -1 where raw is, and past K.
    for (i, row) in batch.rows().iter().enumerate() {
        for c in 0..pp.page_cols {
            let page = got.page[[i, c]];
            let slot = if c < pp.topk && got.raw[[i, c]] >= 0 {
                pg.slots[row.ks + got.raw[[i, c]] as usize]
            } else {
                -1
            };
            prop_assert_eq!(page, slot, "page[{}, {}]", i, c);
        }
    }

    // The chunked driver: the same bits at every budget.
    for b in [1usize, budget, usize::MAX] {
        let (out, plan) = run_cpu(&pp, b).unwrap();
        prop_assert_eq!(
            &out,
            &want,
            "run_cpu at budget {} ({} tiles)",
            b,
            plan.tiles.len()
        );
    }

    // The fast engine, reading the pages in place.
    for isa in Isa::available() {
        let e = bits(&engine_logits(&pp, isa));
        if let Some(i) = first_diff(&e, &want_logits) {
            return Err(TestCaseError::fail(format!(
                "engine logits on {} differ at {i}: paged {:?}, reference {:?}",
                isa.name(),
                e.get(i).map(|b| f32::from_bits(*b)),
                want_logits.get(i).map(|b| f32::from_bits(*b))
            )));
        }
    }
    Ok(())
}

/// Decode batches: contiguous rows, `q0_b = S_b - next_n` (0 for a shorter request),
/// contexts longer than the prefill shapes' so that requests span several pages.
fn decode() -> impl Strategy<Value = Shape> {
    (
        shape_with(4, vec![8, 8, 16]),
        prop::collection::vec(0usize..=300, 1..6),
        1usize..=4,
    )
        .prop_map(|(mut s, seq_lens, next_n)| {
            s.query_starts = seq_lens.iter().map(|&l| l.saturating_sub(next_n)).collect();
            s.seq_lens = seq_lens;
            s.explicit = false;
            s.repeats = false;
            s
        })
}

proptest! {
    #![proptest_config(common::config(64))]

    #[test]
    fn paged_equals_flat(s in shape(), seed in any::<u64>(), budget in 1usize..4000) {
        let pg = paged_from(&build(&s), seed, None);
        check(&pg, budget)?;
    }

    #[test]
    fn decode_paged_equals_flat(s in decode(), seed in any::<u64>(), budget in 1usize..4000, p64 in any::<bool>()) {
        let next_n = s.seq_lens.iter().zip(&s.query_starts).map(|(a, b)| a - b).max();
        let mut d = build(&s);
        d.meta.next_n = next_n.filter(|&n| n > 0);
        prop_assert!(matches!(d.layout, Layout::Contiguous(_)));
        // The engines' page size half the time.
        let pg = paged_from(&d, seed, p64.then_some(64));
        check(&pg, budget)?;
    }
    /// SPEC 8 on random paged layouts: a bad value in a slot some request reads, or a
    /// used table entry out of range, is an error naming that slot or entry (the
    /// garbage everywhere else is not).
    #[test]
    fn bad_read_slots_and_used_entries_are_errors(s in shape(), seed in any::<u64>(), pick in any::<u64>(), what in 0usize..3) {
        let mut pg = paged_from(&build(&s), seed, None);
        let batch = pg.flat.batch().unwrap();
        let keyed: Vec<usize> = (0..batch.requests().len()).filter(|&b| batch.requests()[b].keys > 0).collect();
        prop_assume!(!keyed.is_empty());
        let b = keyed[pick as usize % keyed.len()];
        let j = (pick >> 8) as usize % batch.requests()[b].keys;
        let dim = pg.flat.meta.dim;
        let format = pg.flat.meta.k_format;
        let KData::Paged { kv_cache, page_table, page_size } = &mut pg.paged.k else {
            panic!("not paged")
        };
        let p = *page_size;
        let (page, t) = (page_table[[b, j / p]] as usize, j % p);
        let expect = if what == 0 {
            page_table[[b, j / p]] = [-1, kv_cache.nrows() as i32, i32::MAX][(pick >> 20) as usize % 3];
            format!("page_table[{b}, {}] = ", j / p)
        } else {
            let row = kv_cache.row_mut(page).into_slice().unwrap();
            match (format, what) {
                (dsa_indexer::problem::Format::E4m3, 1) => row[t * dim + (pick >> 20) as usize % dim] = 0x7F,
                (dsa_indexer::problem::Format::E4m3, _) => row[p * dim + 4 * t..p * dim + 4 * t + 4]
                    .copy_from_slice(&[f32::NAN, 0.0, -2.0][(pick >> 20) as usize % 3].to_le_bytes()),
                (dsa_indexer::problem::Format::E2m1, _) => row[p * dim / 2 + t * (dim / 32) + (pick >> 20) as usize % (dim / 32)] = 255,
            }
            format!("kv_cache[page {page}, slot {t}].")
        };
        let published = pg.paged.published_input(&batch);
        match pg.paged.problem(&batch, published.as_ref()) {
            Ok(_) => return Err(TestCaseError::fail(format!("accepted; expected an error starting {expect:?}"))),
            Err(e) => prop_assert!(e.to_string().starts_with(&expect), "{} (expected it to start {:?})", e, expect),
        }
    }
}

/// The layouts the properties run on are the ones they claim: over a few hundred
/// seeds, every page size, shared prefixes, holes, ignored table entries that are -1,
/// in range and out of range, and NaN codes, bad scales or UE8M0 255 in unread slots.
#[test]
fn the_paging_helper_makes_every_kind_of_layout() {
    let mut sizes = std::collections::BTreeSet::new();
    let (mut shared, mut holes, mut minus_one, mut in_range, mut wild, mut junk) =
        (0, 0, 0, 0, 0, 0);
    for seed in 0..400u64 {
        let mut s = Shape::fp4(vec![200, 150, 90, 3], vec![199, 148, 0, 3]);
        s.k_format = [
            dsa_indexer::problem::Format::E2m1,
            dsa_indexer::problem::Format::E4m3,
        ][seed as usize % 2];
        s.seed = seed;
        let d = build(&s);
        let pg = paged_from(&d, seed, None);
        sizes.insert(pg.page_size);
        shared += pg.shared.len();
        holes += pg.holes;
        let KData::Paged {
            kv_cache,
            page_table,
            page_size,
        } = &pg.paged.k
        else {
            panic!("not paged")
        };
        let batch = d.batch().unwrap();
        let mut read = vec![vec![false; *page_size]; kv_cache.nrows()];
        for (b, r) in batch.requests().iter().enumerate() {
            for j in 0..r.keys {
                read[page_table[[b, j / page_size]] as usize][j % page_size] = true;
            }
            for e in r.keys.div_ceil(*page_size)..page_table.ncols() {
                let id = page_table[[b, e]];
                match id {
                    -1 => minus_one += 1,
                    _ if id >= 0 && (id as usize) < kv_cache.nrows() => in_range += 1,
                    _ => wild += 1,
                }
            }
        }
        // Unread slots holding a value SPEC 8 rejects where it is read.
        let dim = d.meta.dim;
        for (pg_id, slots) in read.iter().enumerate() {
            let row = kv_cache.row(pg_id);
            for (t, _) in slots.iter().enumerate().filter(|(_, r)| !**r) {
                let bad = match s.k_format {
                    dsa_indexer::problem::Format::E4m3 => {
                        let at = page_size * dim + 4 * t;
                        let sc =
                            f32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]]);
                        row.iter()
                            .skip(t * dim)
                            .take(dim)
                            .any(|&b| b & 0x7F == 0x7F)
                            || !(sc.is_finite() && sc > 0.0)
                    }
                    dsa_indexer::problem::Format::E2m1 => {
                        let g = dim / 32;
                        row.iter()
                            .skip(page_size * dim / 2 + t * g)
                            .take(g)
                            .any(|&b| b == 255)
                    }
                };
                junk += bad as usize;
            }
        }
    }
    assert_eq!(sizes.len(), 9, "page sizes drawn: {sizes:?}");
    for (what, n) in [
        ("shared prefixes", shared),
        ("holes", holes),
        ("-1 entries", minus_one),
        ("in-range ignored entries", in_range),
        ("out-of-range ignored entries", wild),
        ("bad values in unread slots", junk),
    ] {
        assert!(n > 20, "{what}: {n}");
    }
}
