//! Paged keys (SPEC 10): a small arbitrary layer-forward (`fuzz_common::case::Spec`,
//! every role, format pair and row layout) with its keys laid out in a page pool by
//! `fuzz_common::paging` (random page size, ids in random order with holes, shared
//! prefixes, garbage in everything unread), then up to three structured mutations of
//! the pool, the table or the page size: ids out of range or negative, in-range ids
//! that point elsewhere, tables too narrow or with a row too many or too few, a pool of
//! the wrong width or page count, a page size that is not a power of two or not the
//! pool's, any byte anywhere, NaN codes, bad scales and UE8M0 255 in read and unread
//! slots.
//!
//! A model written from SPEC 8 and 10 (in this file) says whether the layout is valid
//! and, if so, gathers the keys flat. The crate must reject exactly the invalid ones,
//! with an error naming one of the fields the model found wrong, and give, for the
//! valid ones, bitwise the outputs of the model's flat problem (its `k_slots` the pool
//! slots) on the reference and on the chunked driver at a small budget, and the
//! reference's logits on the fast engine. Never a panic.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use dsa_indexer::cpu::{engine_logits, Isa};
use dsa_indexer::dump::{Dump, KData};
use dsa_indexer::indexer::run_cpu;
use dsa_indexer::paged::bytes_per_token;
use dsa_indexer::problem::Format;
use dsa_indexer::reference;
use fuzz_common::case::Spec;
use fuzz_common::dump_file::dump_of;
use fuzz_common::{kind, paging, Rng, STATS};
use libfuzzer_sys::fuzz_target;
use ndarray::{s, Array1, Array2};

/// One structured change of the paged layout (`kind % 10`; 0, a short input's
/// padding, changes nothing).
#[derive(Arbitrary, Debug, Clone, Copy)]
struct Mutation {
    kind: u8,
    a: u16,
    b: u16,
    value: u32,
}

#[derive(Arbitrary, Debug)]
struct Input {
    spec: Spec,
    /// `P = 1 << page % 9`.
    page: u8,
    /// Draws the layout.
    layout_seed: u64,
    muts: [Mutation; 3],
}

/// Bad f32 key scales.
const BAD_SCALES: [f32; 6] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, -1.0];

fn mutate(
    m: Mutation,
    kv: &mut Array2<u8>,
    table: &mut Array2<i32>,
    p: &mut usize,
    f: Format,
    dim: usize,
) {
    let (pages, width) = kv.dim();
    let v = m.value;
    match m.kind % 10 {
        1 => {
            *p = [
                v as usize % 600,
                1 << (v % 10),
                *p * 2,
                *p / 2,
                0,
                3,
                48,
                512,
            ][m.a as usize % 8];
        }
        2 => {
            // Width off by -4..=4 bytes (never 0 change).
            let d = [-4i64, -3, -2, -1, 1, 2, 3, 4][m.a as usize % 8];
            let w = (width as i64 + d).max(0) as usize;
            let mut n = Array2::from_elem((pages, w), v as u8);
            let keep = w.min(width);
            n.slice_mut(s![.., ..keep])
                .assign(&kv.slice(s![.., ..keep]));
            *kv = n;
        }
        3 => {
            let cut = (1 + m.a as usize % 3).min(table.ncols());
            *table = table.slice(s![.., ..table.ncols() - cut]).to_owned();
        }
        4 => {
            let rows = table.nrows();
            *table = if m.a.is_multiple_of(2) && rows > 0 {
                table.slice(s![..rows - 1, ..]).to_owned()
            } else {
                let mut n = Array2::from_elem((rows + 1, table.ncols()), -1);
                n.slice_mut(s![..rows, ..]).assign(table);
                n
            };
        }
        5 if !table.is_empty() => {
            let (r, c) = (m.a as usize % table.nrows(), m.b as usize % table.ncols());
            let n = pages as i32;
            table[[r, c]] = [
                -1,
                n,
                n + 1 + (v % 8) as i32,
                i32::MIN,
                i32::MAX,
                (v % (pages as u32 + 1)) as i32,
                v as i32,
            ][(v >> 24) as usize % 7];
        }
        6 if !kv.is_empty() => {
            let (r, c) = (m.a as usize % pages, m.b as usize % width);
            kv[[r, c]] = v as u8;
        }
        7 if !kv.is_empty() => {
            // A reserved code or scale byte somewhere in the page's value region.
            let r = m.a as usize % pages;
            match f {
                Format::E4m3 => {
                    let c = m.b as usize % (width * dim / (dim + 4)).max(1);
                    kv[[r, c.min(width - 1)]] = [0x7F, 0xFF][v as usize % 2];
                }
                Format::E2m1 => {
                    let codes = width * (dim / 2) / (dim / 2 + dim / 32);
                    let c = codes + m.b as usize % (width - codes).max(1);
                    kv[[r, c.min(width - 1)]] = 255;
                }
            }
        }
        8 if !kv.is_empty() => {
            // A bad E4M3 scale (or any E2M1 code byte) at one slot of a page.
            let r = m.a as usize % pages;
            match f {
                Format::E4m3 => {
                    let tokens = width / (dim + 4);
                    if tokens > 0 {
                        let at = tokens * dim + 4 * (m.b as usize % tokens);
                        let x = BAD_SCALES[v as usize % BAD_SCALES.len()].to_le_bytes();
                        kv.row_mut(r).as_slice_mut().unwrap()[at..at + 4].copy_from_slice(&x);
                    }
                }
                Format::E2m1 => kv[[r, m.b as usize % width]] = v as u8,
            }
        }
        9 => {
            let mut n = Array2::from_elem((pages + 1, width), v as u8);
            n.slice_mut(s![..pages, ..]).assign(kv);
            *kv = if m.a.is_multiple_of(2) && pages > 0 {
                kv.slice(s![..pages - 1, ..]).to_owned()
            } else {
                n
            };
        }
        _ => {}
    }
}

/// The model's verdict: the fields SPEC 8 finds wrong (empty: valid), and for a valid
/// layout the keys gathered flat with their pool slots.
struct Model {
    wrong: Vec<String>,
    flat: Option<(KData, Array1<i32>)>,
}

fn model(d: &Dump) -> Model {
    let KData::Paged {
        kv_cache: kv,
        page_table: table,
        page_size: p,
    } = &d.k
    else {
        unreachable!("paged keys")
    };
    let p = *p;
    let batch = d.batch().expect("a spec's batch");
    let (dim, f) = (d.meta.dim, d.meta.k_format);
    let mut wrong = Vec::new();
    let p_ok = p.is_power_of_two() && p <= 256;
    if !p_ok {
        wrong.push("page_size".to_string());
    }
    let width_ok = p_ok && kv.ncols() == p * bytes_per_token(f, dim);
    if p_ok && !width_ok {
        wrong.push("kv_cache".into());
    }
    let reqs = batch.requests();
    if table.nrows() != reqs.len() {
        wrong.push("page_table".into());
        return Model { wrong, flat: None };
    }
    let g = dim / 32;
    let cw = match f {
        Format::E4m3 => dim,
        Format::E2m1 => dim / 2,
    };
    let l = batch.num_keys();
    let mut codes = Array2::<u8>::zeros((l, cw));
    let mut e4 = Array1::<f32>::zeros(l);
    let mut e2 = Array2::<u8>::zeros((l, g));
    let mut slots = Array1::<i32>::zeros(l);
    for (b, r) in reqs.iter().enumerate() {
        if !p_ok {
            continue;
        }
        let need = r.keys.div_ceil(p);
        if need > table.ncols() {
            wrong.push(format!("page_table[{b}]"));
        }
        for j in 0..r.keys {
            let e = j / p;
            if e >= table.ncols() {
                break;
            }
            let id = table[[b, e]];
            if id < 0 || id as usize >= kv.nrows() {
                if j % p == 0 {
                    wrong.push(format!("page_table[{b}, {e}]"));
                }
                continue;
            }
            if !width_ok {
                continue;
            }
            let (page, t) = (id as usize, j % p);
            let row = kv.row(page);
            let x = r.key_offset + j;
            slots[x] = (page * p + t) as i32;
            let field = format!("kv_cache[page {page}, slot {t}]");
            let c = row.slice(s![t * cw..(t + 1) * cw]);
            codes.row_mut(x).assign(&c);
            match f {
                Format::E4m3 => {
                    let at = p * dim + 4 * t;
                    let sc = f32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]]);
                    e4[x] = sc;
                    if c.iter().any(|&b| b & 0x7F == 0x7F) || !(sc.is_finite() && sc > 0.0) {
                        wrong.push(field);
                    }
                }
                Format::E2m1 => {
                    let at = p * dim / 2 + t * g;
                    let sc = row.slice(s![at..at + g]);
                    e2.row_mut(x).assign(&sc);
                    if sc.iter().any(|&b| b == 255) {
                        wrong.push(field);
                    }
                }
            }
        }
    }
    let flat = wrong.is_empty().then(|| {
        let k = match f {
            Format::E4m3 => KData::E4m3 { codes, scale: e4 },
            Format::E2m1 => KData::E2m1 {
                packed: codes,
                scale: e2,
            },
        };
        (k, slots)
    });
    Model { wrong, flat }
}

fuzz_target!(|data: &[u8]| {
    STATS.input("paged");
    let input = Input::arbitrary_take_rest(Unstructured::new(data)).expect("fixed-size fields");
    let Some((flat, _)) = dump_of(&input.spec) else {
        STATS.note("consumer:no-rows");
        return;
    };
    let mut rng = Rng(input.layout_seed);
    let pg = paging::page(&flat, Some(1 << (input.page % 9)), &mut |n| rng.below(n));
    let mut d = pg.paged.clone();
    let (dim, f) = (d.meta.dim, d.meta.k_format);
    if let KData::Paged {
        kv_cache,
        page_table,
        page_size,
    } = &mut d.k
    {
        for m in input.muts {
            mutate(m, kv_cache, page_table, page_size, f, dim);
        }
    }
    let want = model(&d);

    let batch = d.batch().expect("a spec's batch");
    let published = d.published_input(&batch);
    let p = match d.problem(&batch, published.as_ref()) {
        Ok(p) => {
            assert!(
                want.wrong.is_empty(),
                "accepted, but the model finds {:?} wrong",
                want.wrong
            );
            p
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(!want.wrong.is_empty(), "valid paged layout rejected: {msg}");
            assert!(
                want.wrong.iter().any(|w| [" ", ":", "."]
                    .iter()
                    .any(|c| msg.starts_with(&format!("{w}{c}")))),
                "error `{msg}` names none of {:?}",
                want.wrong
            );
            STATS.note(format!("problem:{}", kind(&e)));
            return;
        }
    };
    let (keys, slots) = want.flat.expect("a valid layout gathers");
    let mut fd = d.clone();
    fd.k = keys;
    fd.k_slots = Some(slots);
    let fp = fd
        .problem(&batch, published.as_ref())
        .expect("the gathered flat problem is valid");

    let logits = reference::logits(&fp);
    let lbits: Vec<u32> = logits.iter().map(|x| x.to_bits()).collect();
    let pbits: Vec<u32> = reference::logits(&p).iter().map(|x| x.to_bits()).collect();
    assert!(lbits == pbits, "reference logits, paged vs flat");
    let out = reference::run(&fp);
    assert_eq!(reference::run(&p), out, "reference outputs, paged vs flat");
    let budget = 1 + (input.layout_seed % 4096) as usize;
    let (got, _) = run_cpu(&p, budget).expect("run_cpu on a valid problem");
    assert_eq!(
        got, out,
        "run_cpu at budget {budget}, paged vs flat reference"
    );
    let isa = Isa::detect();
    let e: Vec<u32> = engine_logits(&p, isa).iter().map(|x| x.to_bits()).collect();
    assert!(
        e == lbits,
        "engine logits on {}, paged vs reference",
        isa.name()
    );
    STATS.reached();
});
