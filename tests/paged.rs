//! Paged keys (SPEC 10): the golden files of `tests/golden/paged/` reproduced bitwise by
//! the reference, the chunked driver at every budget and the fast CPU engine; each
//! file's paged problem equal to the same problem with its keys gathered flat; and the
//! paged inputs SPEC 8 rejects.

mod common;

use common::{bits, check, check_expected_outputs, paged_golden_files};
use dsa_indexer::cpu::{engine_logits, Isa};
use dsa_indexer::dump::{Dump, KData};
use dsa_indexer::error::Error;
use dsa_indexer::indexer::run_cpu;
use dsa_indexer::reference;
use ndarray::Array2;

fn load(path: &std::path::Path) -> (String, Dump) {
    let name = path.file_name().unwrap().to_string_lossy().to_string();
    let dump =
        Dump::from_bytes(&std::fs::read(path).unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
    (name, dump)
}

#[test]
fn reference_reproduces_every_paged_golden_file() {
    let files = paged_golden_files();
    assert!(
        files.len() >= 7,
        "expected the paged golden files, found {}",
        files.len()
    );
    for path in files {
        let (name, dump) = load(&path);
        assert!(matches!(dump.k, KData::Paged { .. }), "{name}: not paged");
        let batch = dump.batch().unwrap_or_else(|e| panic!("{name}: {e}"));
        let published = dump.published_input(&batch);
        let p = dump
            .problem(&batch, published.as_ref())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(p.paged().is_some(), "{name}: problem not paged");
        let e = &dump.expected;
        check(
            &name,
            "logits (bits)",
            &bits(&reference::logits(&p)),
            &bits(e.logits.as_ref().expect("expected_logits")),
        );
        check_expected_outputs(&name, &p, &reference::run(&p), e);
    }
}

#[test]
fn chunked_driver_and_fast_engine_reproduce_the_paged_golden_files() {
    for path in paged_golden_files() {
        let (name, dump) = load(&path);
        let batch = dump.batch().unwrap();
        let published = dump.published_input(&batch);
        let p = dump.problem(&batch, published.as_ref()).unwrap();
        let e = &dump.expected;
        for budget in [1usize, 64, 1000, 1 << 20, usize::MAX] {
            let (out, plan) = run_cpu(&p, budget).unwrap();
            let tag = format!("{name} at budget {budget} ({} tiles)", plan.tiles.len());
            check_expected_outputs(&tag, &p, &out, e);
        }
        for isa in Isa::available() {
            check(
                &format!("{name} on {}", isa.name()),
                "engine logits (bits)",
                &bits(&engine_logits(&p, isa)),
                &bits(e.logits.as_ref().unwrap()),
            );
        }
    }
}

#[test]
fn paged_and_gathered_flat_problems_agree_bitwise() {
    for path in paged_golden_files() {
        let (name, dump) = load(&path);
        let batch = dump.batch().unwrap();
        let published = dump.published_input(&batch);
        let p = dump.problem(&batch, published.as_ref()).unwrap();
        let flat = p.gather_keys().expect("paged");
        let f = p.with_flat_keys(&flat);
        assert!(f.paged().is_none());
        check(
            &name,
            "logits (bits)",
            &bits(&reference::logits(&f)),
            &bits(&reference::logits(&p)),
        );
        let (a, b) = (reference::run(&p), reference::run(&f));
        assert_eq!(a, b, "{name}: paged and flat outputs");
    }
}

/// The first paged golden file with E4M3 keys, and with E2M1 keys.
fn golden(format_e4m3: bool) -> Dump {
    for path in paged_golden_files() {
        let (_, d) = load(&path);
        if (d.meta.k_format == dsa_indexer::problem::Format::E4m3) == format_e4m3
            && d.meta.role == dsa_indexer::dump::RoleKind::Plain
        {
            return d;
        }
    }
    panic!("no paged golden file of that key format");
}

fn problem_error(d: &Dump) -> Option<Error> {
    let batch = d.batch().unwrap();
    let published = d.published_input(&batch);
    d.problem(&batch, published.as_ref()).err()
}

/// A paged dump's pool, page table and page size.
fn pool(d: &Dump) -> (&Array2<u8>, &Array2<i32>, usize) {
    match &d.k {
        KData::Paged {
            kv_cache,
            page_table,
            page_size,
        } => (kv_cache, page_table, *page_size),
        _ => panic!("not paged"),
    }
}

/// [`pool`], to edit.
fn pool_mut(d: &mut Dump) -> (&mut Array2<u8>, &mut Array2<i32>, &mut usize) {
    match &mut d.k {
        KData::Paged {
            kv_cache,
            page_table,
            page_size,
        } => (kv_cache, page_table, page_size),
        _ => panic!("not paged"),
    }
}

/// The page and the slot in it of key `j` of request `b`.
fn used_slot(d: &Dump, b: usize, j: usize) -> (usize, usize) {
    let (_, table, p) = pool(d);
    (table[[b, j / p]] as usize, j % p)
}

/// The page and slot of key 0 of the first request with keys: a slot that is read.
fn first_read_slot(d: &Dump) -> (usize, usize) {
    let batch = d.batch().unwrap();
    let b = (0..batch.requests().len())
        .find(|&b| batch.requests()[b].keys > 0)
        .unwrap();
    used_slot(d, b, 0)
}

#[test]
fn bad_page_tables_and_pools_are_errors_naming_the_field() {
    let base = golden(true);
    let batch = base.batch().unwrap();
    let (b, req) = batch
        .requests()
        .iter()
        .enumerate()
        .find(|(_, r)| r.keys > 0)
        .map(|(b, r)| (b, *r))
        .unwrap();
    let msg = |d: &Dump| problem_error(d).map(|e| e.to_string()).unwrap_or_default();

    // A used entry out of range, and negative.
    for bad in [i32::MAX, -1] {
        let mut d = base.clone();
        let (_, pt, _) = pool_mut(&mut d);
        pt[[b, 0]] = if bad < 0 {
            bad
        } else {
            pool(&base).0.nrows() as i32
        };
        let m = msg(&d);
        assert!(m.contains(&format!("page_table[{b}, 0]")), "{m}");
    }
    // A table too narrow for L_b.
    {
        let mut d = base.clone();
        let need = req.keys.div_ceil(pool(&base).2);
        let (_, pt, _) = pool_mut(&mut d);
        *pt = pt.slice(ndarray::s![.., ..need - 1]).to_owned();
        let m = msg(&d);
        assert!(m.contains("page_table["), "{m}");
    }
    // A pool whose width is not P * bytes_per_token.
    {
        let mut d = base.clone();
        let (kv, _, _) = pool_mut(&mut d);
        *kv = kv.slice(ndarray::s![.., ..kv.ncols() - 4]).to_owned();
        let m = msg(&d);
        assert!(m.starts_with("kv_cache: shape"), "{m}");
    }
    // P not a power of two, and above 256.
    for bad in [48usize, 512] {
        let mut d = base.clone();
        *pool_mut(&mut d).2 = bad;
        let m = msg(&d);
        assert!(m.starts_with(&format!("page_size = {bad}")), "{m}");
    }
    // k_slots beside paged keys.
    {
        let mut d = base.clone();
        d.k_slots = Some(ndarray::Array1::zeros(batch.num_keys()));
        let m = msg(&d);
        assert!(m.starts_with("k_slots"), "{m}");
    }
}

#[test]
fn bad_values_in_read_slots_are_errors_and_unread_slots_are_not_checked() {
    // E4M3 keys: a NaN code and a bad scale in a slot a request reads.
    let base = golden(true);
    let batch = base.batch().unwrap();
    let dim = base.meta.dim;
    let (page, t) = first_read_slot(&base);
    let p = pool(&base).2;
    {
        let mut d = base.clone();
        pool_mut(&mut d).0[[page, t * dim + 3]] = 0x7F;
        let m = problem_error(&d).unwrap().to_string();
        assert!(
            m.starts_with(&format!("kv_cache[page {page}, slot {t}].k[3] = 0x7f")),
            "{m}"
        );
    }
    for bad in [-1.0f32, 0.0, f32::NAN, f32::INFINITY] {
        let mut d = base.clone();
        let at = p * dim + 4 * t;
        pool_mut(&mut d).0.row_mut(page).as_slice_mut().unwrap()[at..at + 4]
            .copy_from_slice(&bad.to_le_bytes());
        let m = problem_error(&d).unwrap().to_string();
        assert!(
            m.starts_with(&format!("kv_cache[page {page}, slot {t}].scale")),
            "{m}"
        );
    }
    // Garbage in every page no used entry names, and in entries past every L_b: fine.
    {
        let mut d = base.clone();
        let mut used = vec![false; pool(&base).0.nrows()];
        for (bb, r) in batch.requests().iter().enumerate() {
            for e in 0..r.keys.div_ceil(p) {
                used[used_slot(&base, bb, e * p).0] = true;
            }
        }
        assert!(used.iter().any(|u| !u), "the golden pool has unused pages");
        let (kv, pt, _) = pool_mut(&mut d);
        for (pg, u) in used.iter().enumerate() {
            if !u {
                kv.row_mut(pg).fill(0x7F);
            }
        }
        for (bb, r) in batch.requests().iter().enumerate() {
            for e in r.keys.div_ceil(p)..pt.ncols() {
                pt[[bb, e]] = -7;
            }
        }
        assert!(problem_error(&d).is_none(), "{:?}", problem_error(&d));
    }
    // E2M1 keys: UE8M0 255 in a read slot.
    let base = golden(false);
    let dim = base.meta.dim;
    let (page, t) = first_read_slot(&base);
    let p = pool(&base).2;
    let mut d = base.clone();
    pool_mut(&mut d).0[[page, p * dim / 2 + t * (dim / 32) + 1]] = 255;
    let m = problem_error(&d).unwrap().to_string();
    assert!(
        m.starts_with(&format!("kv_cache[page {page}, slot {t}].k_scale[1] = 255")),
        "{m}"
    );
}
