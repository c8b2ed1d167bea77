//! Structure-aware dumps (SPEC 9): a valid dump of a small arbitrary layer-forward
//! (`fuzz_common::case::Spec`, every role, format pair and row layout, its expected
//! outputs included), written by the crate, taken apart into its tensors and metadata,
//! mutated in a structured way and written again.
//!
//! - With only meaning-keeping mutations (another accepted dtype for the same values, a
//!   reordered data section, header padding, extra keys and tensors, numbers spelt with
//!   spaces or leading zeros, a dropped `expected_*`), the file must read back as the
//!   same dump, and replay (reference and chunked driver) bitwise to the reference's
//!   outputs of the unmutated problem.
//! - With one more mutation that may break it (a quarter of inputs: metadata values,
//!   shapes, dtypes, offsets, sizes, names, bytes, the header length), the file is
//!   either an `Error::Dump` naming a tensor of the schema or of the file, the header
//!   or the metadata, or a dump that round-trips and, when its batch and problem
//!   validate, replays on the chunked driver bitwise as on the reference.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use dsa_indexer::dump::{Dump, Expected};
use dsa_indexer::{reference, Error};
use fuzz_common::case::{check_output, check_plan, Spec};
use fuzz_common::dump_file::{assert_same_dump, dump_of, Break, File, Keep, TENSORS};
use fuzz_common::{kind, STATS};
use libfuzzer_sys::fuzz_target;

/// Replays of a mutated dump with `sum n * H * D` above this are only validated.
const MAX_COST: usize = 1 << 22;
/// Meaning-keeping mutations applied, at most.
const MAX_KEEP: usize = 8;

#[derive(Arbitrary, Debug)]
struct Input {
    spec: Spec,
    /// `% 4 == 3`: apply `brk` after the kept-meaning mutations (not when the input ends
    /// before this byte, which reads as 0).
    breaking: u8,
    brk: Break,
    keep: Vec<Keep>,
}

/// The dump with its free text and expected outputs cleared: what its replay depends on.
fn problem_part(d: &Dump) -> Dump {
    let mut d = d.clone();
    d.meta.description.clear();
    d.expected = Expected::default();
    d
}

fuzz_target!(|data: &[u8]| {
    STATS.input("dump_struct");
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else {
        STATS.note("decode");
        return;
    };
    let Some((orig, want_out)) = dump_of(&input.spec) else {
        STATS.note("consumer:no-rows");
        return;
    };
    let bytes = orig.to_bytes().expect("a valid dump serialises");
    assert_same_dump(
        &Dump::from_bytes(&bytes).expect("the crate's file reads"),
        &orig,
        "the crate's own file",
    );
    let mut file = File::parse(&bytes);
    let mut want = orig.clone();
    for k in input.keep.iter().take(MAX_KEEP) {
        k.apply(&mut file, &mut want);
    }
    let breaking = input.breaking % 4 == 3;
    if breaking {
        input.brk.apply(&mut file);
    }
    let bytes = file.to_bytes();

    let dump = match Dump::from_bytes(&bytes) {
        Ok(d) => d,
        Err(e) => {
            assert!(breaking, "a file of kept meaning rejected: {e} ({input:?})");
            match &e {
                Error::Dump { tensor, .. } => assert!(
                    TENSORS.contains(&tensor.as_str())
                        || file.entries.iter().any(|t| &t.name == tensor)
                        || tensor == "header"
                        || tensor == "__metadata__",
                    "the error names no tensor of the schema or the file: {e}"
                ),
                _ => panic!("a file's error is not Error::Dump: {e}"),
            }
            STATS.note(format!("parse:{}", kind(&e)));
            return;
        }
    };
    if !breaking {
        assert_same_dump(&dump, &want, "a file of kept meaning reads as another dump");
    }
    let again = Dump::from_bytes(&dump.to_bytes().expect("a parsed dump serialises"))
        .expect("a written dump parses");
    assert_same_dump(&again, &dump, "dump round trip");

    let batch = match dump.batch() {
        Ok(b) => b,
        Err(e) => {
            assert!(breaking, "the batch of kept meaning rejected: {e}");
            STATS.note(format!("batch:{}", kind(&e)));
            return;
        }
    };
    let published = dump.published_input(&batch);
    let p = match dump.problem(&batch, published.as_ref()) {
        Ok(p) => p,
        Err(e) => {
            assert!(breaking, "the problem of kept meaning rejected: {e}");
            STATS.note(format!("problem:{}", kind(&e)));
            return;
        }
    };
    let cost = batch
        .valid_pairs()
        .saturating_mul(p.heads)
        .saturating_mul(p.dim);
    if cost > MAX_COST {
        assert!(breaking, "the unmutated problem is small");
        STATS.note("valid:large");
        return;
    }
    let out = reference::run(&p);
    check_output(&p, &out);
    let budget = input.spec.budgets()[0];
    let (got, plan) = dsa_indexer::indexer::run_cpu(&p, budget).expect("a valid dump runs");
    check_plan(&p, &plan, budget);
    assert_eq!(got, out, "chunked driver vs reference on a dump");
    if problem_part(&dump) == problem_part(&orig) {
        // The unmutated problem: the reference's outputs computed before the file.
        assert_eq!(out, want_out, "replay vs the unmutated problem's reference");
        if !breaking {
            // What the file carries as expected outputs is what its replay gives.
            let e = &dump.expected;
            if let Some(raw) = &e.raw {
                assert_eq!(raw, &out.raw, "expected_raw vs replay");
            }
            if let Some(page) = &e.page {
                assert_eq!(page, &out.page, "expected_page vs replay");
            }
            if let Some(pb) = &e.published {
                let blocks = out.published.as_ref().map(|o| &o.blocks);
                assert_eq!(Some(pb), blocks, "expected_published vs replay");
            }
        }
    } else {
        assert!(breaking, "a file of kept meaning changed the problem");
        STATS.note("compared:mutated");
    }
    STATS.reached();
});
