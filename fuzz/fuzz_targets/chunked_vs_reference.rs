//! An arbitrary small layer-forward through the chunked driver (CPU backend, two
//! budgets, 1 to 3 rayon threads) must give bitwise the reference's untiled `raw`,
//! `page` and published candidates, and the CPU engine's logits (every instruction set
//! this CPU has) bitwise the reference's; defective inputs must come back as `Error`.
//! The bytes decode as `fuzz_common::case::Spec` (fixed layout, short inputs padded
//! with zeros, so every execution is counted).
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use fuzz_common::case::{self, Cpu, Spec};
use fuzz_common::STATS;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    STATS.input("chunked_vs_reference");
    let spec = Spec::arbitrary_take_rest(Unstructured::new(data)).expect("fixed-size fields");
    case::check(&spec, &mut Cpu);
});
