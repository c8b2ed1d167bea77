//! One structured layer-forward, built from fuzzer bytes so that most inputs pass
//! validation: a small ragged batch (contiguous or explicit rows, prefix hits, empty
//! requests), every format pair, small value palettes (ties), arbitrary f32 weights and
//! key scales (overflow to infinity, NaN logits), the three roles with tails, small
//! `B` and `NB`, two budgets and a thread count. When its first byte says so (a
//! quarter of random bytes; about 13 % of what libFuzzer feeds it), an input carries one
//! deliberate defect (a NaN code, scale byte 255, a zero parameter, a bad consumer
//! row...), and then the crate must answer with its error type.
//!
//! - [`spec`]: the fuzzer's bytes as a [`Spec`] and the shapes decided from it;
//! - [`synth`]: the input tensors filled from its seed and palettes;
//! - [`defect`]: the deliberate defects and how each is applied;
//! - [`subject`]: the backend under test, its bound, the CPU backend;
//! - [`check`]: one case built, run and compared;
//! - [`oracle`]: the checks, independent of the crate where they can be;
//! - [`seeds`]: the committed seed cases.

mod check;
mod defect;
mod oracle;
mod seeds;
mod spec;
mod subject;
mod synth;
#[cfg(test)]
mod tests;

pub use check::check;
pub use defect::Defect;
pub use oracle::{
    check_layout, check_logits, check_output, check_plan, check_selection, magnitude,
    select_from_scores,
};
pub use seeds::seeds;
pub use spec::{Layout, Spec, MAX_ROWS};
pub use subject::{on_pool, BackendRun, Cpu, LogitBound, Subject};
pub use synth::{inputs, Owned, OwnedKeys};
