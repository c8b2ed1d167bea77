//! The replay verdict on paged dumps (SPEC 9, 10): `page` is judged as pool slots
//! (`page_table[b, j / P] * P + j % P`) of the `raw` ids, and, without `raw`, as the
//! selection those pool slots name. Every paged golden file replayed against its own
//! expected tensors is identical; a moved slot, or request-local ids where pool slots
//! belong, is different.

mod common;

use common::paged_golden_files;
use dsa_indexer::dump::{Dump, Expected};
use dsa_indexer::reference;
use dsa_indexer::verdict::{self, Options, Status, Tolerance, Verdict};

fn load(path: &std::path::Path) -> (String, Dump) {
    let name = path.file_name().unwrap().to_string_lossy().to_string();
    let dump =
        Dump::from_bytes(&std::fs::read(path).unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
    (name, dump)
}

/// The verdict on `expected` for the dump's problem, replayed on the reference.
fn judge(dump: &Dump, expected: &Expected) -> Verdict {
    let batch = dump.batch().unwrap();
    let published = dump.published_input(&batch);
    let p = dump.problem(&batch, published.as_ref()).unwrap();
    let out = reference::run(&p);
    let opts = Options {
        row_numbers: None,
        max_notes: 3,
        full_ids: false,
        tolerance: Tolerance::Auto,
    };
    verdict::judge(&p, &out, expected, None, &opts).unwrap()
}

fn part(v: &Verdict, name: &str) -> (Status, Option<usize>) {
    let t = v
        .tensors
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no part {name} in {:?}", v.tensors));
    (t.status, t.first_different_row)
}

/// A row with a selection, and a pool slot that no key of that row has.
fn row_and_foreign_slot(dump: &Dump) -> (usize, i32) {
    let page = dump.expected.page.as_ref().unwrap();
    let i = (0..page.nrows()).find(|&i| page[[i, 0]] >= 0).unwrap();
    let row: Vec<i32> = page.row(i).to_vec();
    let foreign = (0..i32::MAX).find(|s| !row.contains(s)).unwrap();
    (i, foreign)
}

#[test]
fn every_paged_golden_file_against_its_own_expected_tensors_is_identical() {
    let files = paged_golden_files();
    assert!(files.len() >= 7, "found {} paged golden files", files.len());
    for path in files {
        let (name, dump) = load(&path);
        let v = judge(&dump, &dump.expected);
        assert_eq!(v.status, Status::Identical, "{name}: {v:?}");
        assert_eq!(part(&v, "page").0, Status::Identical, "{name}");
        // Without raw, page alone names the selection through the pool slots.
        let page_only = Expected {
            raw: None,
            ..dump.expected.clone()
        };
        let v = judge(&dump, &page_only);
        assert_eq!(part(&v, "page").0, Status::Identical, "{name}: page alone");
    }
}

#[test]
fn a_moved_pool_slot_is_different_and_a_reordered_row_is_equal_up_to_ties() {
    for path in paged_golden_files() {
        let (name, dump) = load(&path);
        let (i, foreign) = row_and_foreign_slot(&dump);
        let mut moved = dump.expected.clone();
        moved.page.as_mut().unwrap()[[i, 0]] = foreign;
        let v = judge(&dump, &moved);
        assert_eq!(part(&v, "raw").0, Status::Identical, "{name}");
        assert_eq!(part(&v, "page"), (Status::Different, Some(i)), "{name}");
        assert_eq!(v.status, Status::Different, "{name}");
        // The same without raw: the moved slot names no key of the row, or another one.
        let page_only = Expected { raw: None, ..moved };
        let v = judge(&dump, &page_only);
        assert_eq!(part(&v, "page").0, Status::Different, "{name}: page alone");
        // Row i's slots in another order: the same slots, equal up to ties.
        let mut swapped = dump.expected.clone();
        let pg = swapped.page.as_mut().unwrap();
        let n = pg.row(i).iter().filter(|&&s| s >= 0).count();
        if n >= 2 {
            pg.swap([i, 0], [i, n - 1]);
            let v = judge(&dump, &swapped);
            assert_eq!(part(&v, "page").0, Status::Ties, "{name}: swapped");
        }
    }
}

#[test]
fn request_local_ids_where_pool_slots_belong_are_different() {
    // The decode files' pages lie in random order: slots and ids differ.
    let path = paged_golden_files()
        .into_iter()
        .find(|p| p.ends_with("paged_decode_e4m3.safetensors"))
        .unwrap();
    let (_, dump) = load(&path);
    let raw = dump.expected.raw.as_ref().unwrap();
    let mut page = dump.expected.page.clone().unwrap();
    page.fill(-1);
    for ((i, c), &j) in raw.indexed_iter() {
        page[[i, c]] = j;
    }
    assert_ne!(Some(&page), dump.expected.page.as_ref());
    let ids_as_page = Expected {
        page: Some(page),
        ..dump.expected.clone()
    };
    let v = judge(&dump, &ids_as_page);
    assert_eq!(part(&v, "page").0, Status::Different);
    assert_eq!(part(&v, "raw").0, Status::Identical);
}

/// A page listed twice in one request's page table (SPEC 10 allows it): two keys share
/// each of its pool slots, and a `page` naming such a slot twice is still the selection
/// of both keys.
#[test]
fn a_page_listed_twice_in_a_request_names_two_keys_per_slot() {
    use dsa_indexer::dump::KData;
    let path = paged_golden_files()
        .into_iter()
        .find(|p| p.ends_with("paged_decode_mtp.safetensors"))
        .unwrap();
    let (_, mut dump) = load(&path);
    let KData::Paged { page_table, .. } = &mut dump.k else {
        panic!("not paged");
    };
    // Every request of two or more used pages reads its first page again as its second.
    let mut doubled = 0;
    for (b, &s) in dump.seq_lens.clone().iter().enumerate() {
        if s > 16 {
            page_table[[b, 1]] = page_table[[b, 0]];
            doubled += 1;
        }
    }
    assert!(doubled > 0);
    let batch = dump.batch().unwrap();
    let p = dump.problem(&batch, None).unwrap();
    let out = reference::run(&p);
    let dup = out.page.rows().into_iter().any(|r| {
        let mut v: Vec<i32> = r.iter().copied().filter(|&x| x >= 0).collect();
        v.sort_unstable();
        v.windows(2).any(|w| w[0] == w[1])
    });
    assert!(dup, "no row selects two keys of one slot");
    let page_only = Expected {
        page: Some(out.page.clone()),
        ..Expected::default()
    };
    let v = judge(&dump, &page_only);
    assert_eq!(part(&v, "page").0, Status::Identical, "{v:?}");
    // Each row's slots reversed: not the reference's form, so `page` is read back to ids
    // through the slots, and a slot named twice is two keys.
    let mut reversed = out.page.clone();
    for mut r in reversed.rows_mut() {
        let mut v: Vec<i32> = r.iter().copied().filter(|&x| x >= 0).collect();
        v.reverse();
        for (c, x) in v.into_iter().enumerate() {
            r[c] = x;
        }
    }
    assert_ne!(reversed, out.page);
    let v = judge(
        &dump,
        &Expected {
            page: Some(reversed),
            ..Expected::default()
        },
    );
    assert_eq!(part(&v, "page").0, Status::Ties, "{v:?}");
}
