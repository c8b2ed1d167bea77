//! Arbitrary bytes as a layer-forward dump (SPEC 9): a typed error or a valid problem,
//! never a panic or an unbounded allocation. A dump that validates is written back and
//! re-read (same dump), and, when small enough, replayed on the reference and on the
//! chunked CPU driver, which must agree bitwise. Seeded with the golden files.
#![no_main]

use dsa_indexer::dump::Dump;
use dsa_indexer::reference;
use fuzz_common::{kind, STATS};
use libfuzzer_sys::fuzz_target;

/// Replays with `sum n * H * D` above this are only validated.
const MAX_COST: usize = 1 << 22;

fuzz_target!(|data: &[u8]| {
    STATS.input("dump_parse");
    let dump = match Dump::from_bytes(data) {
        Ok(d) => d,
        Err(e) => {
            assert!(matches!(e, dsa_indexer::Error::Dump { .. }), "{e}");
            STATS.note(format!("parse:{}", kind(&e)));
            return;
        }
    };
    // Written back, the dump reads the same.
    let bytes = dump.to_bytes().expect("a parsed dump serialises");
    let again = Dump::from_bytes(&bytes).expect("a written dump parses");
    fuzz_common::dump_file::assert_same_dump(&again, &dump, "dump round trip");

    let batch = match dump.batch() {
        Ok(b) => b,
        Err(e) => {
            STATS.note(format!("batch:{}", kind(&e)));
            return;
        }
    };
    let published = dump.published_input(&batch);
    let p = match dump.problem(&batch, published.as_ref()) {
        Ok(p) => p,
        Err(e) => {
            STATS.note(format!("problem:{}", kind(&e)));
            return;
        }
    };
    let cost = batch
        .valid_pairs()
        .saturating_mul(p.heads)
        .saturating_mul(p.dim);
    if cost > MAX_COST {
        STATS.note("valid:large");
        return;
    }
    let want = reference::run(&p);
    fuzz_common::case::check_output(&p, &want);
    let budget = 1 + data.len() % 4096;
    let (got, plan) = dsa_indexer::indexer::run_cpu(&p, budget).expect("a valid dump runs");
    fuzz_common::case::check_plan(&p, &plan, budget);
    assert_eq!(got, want, "chunked driver vs reference on a dump");
    STATS.reached();
});
