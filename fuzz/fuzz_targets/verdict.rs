//! SPEC 9's verdict on a mutated engine dump against a model of the rule written in the
//! fuzz crate (`fuzz_common::verdict_case`), not the library's judge: per part and per
//! row, the status, the counts and each differing row's margin. A key moved outside the
//! tolerance is different; a swap of exactly tied keys, or the same ids in another
//! order, is equal up to ties; with `engine_logits` the selections must be exactly SPEC
//! 5's selection of the engine's own logits.
#![no_main]

use fuzz_common::verdict_case::{check, VerdictCase};
use fuzz_common::STATS;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|case: VerdictCase| {
    STATS.input("verdict");
    let built = case.build();
    let v = check(&built);
    STATS.note(format!("verdict:{}", v.status.as_str().replace(' ', "_")));
    STATS.reached();
});
