//! `chunked_vs_reference`'s cases through the CUDA backend (`--features cuda`, an sm_90
//! GPU). Exact class (fp4 x fp4): logits, `raw`, `page` and published candidates
//! bitwise the reference's. Tolerance class: logits within the backend's stated bound,
//! `cuda::logit_bound` (`2^cuda::TOLERANCE_LOG2 * M` plus the absolute term of f32
//! rounding in the subnormal range, without which it fails on results below 2^-126:
//! fuzz/FINDINGS.md F3), a non-finite logit equal to the reference's (the same
//! infinity, or NaN on both sides); outputs that meet SPEC 5's rule on the reference's
//! scores (and SPEC 6's kept blocks the same rule on block scores), bitwise the
//! reference's selection from the device's own logits (SPEC 5: same scores, same
//! selection), and bitwise the same under both budgets. Defective inputs must come back
//! as `Error`. No GPU is a failure at the first input, not a pass.
//!
//! `DSA_FUZZ_PRECISION=fast` runs the backend in the fast precision
//! (`cuda::Precision::Fast`: E4M3 x E4M3 at H = 64 on fp8 `wgmma`) and holds it to the
//! bound SPEC 4 states for it, through the same `cuda::logit_bound`.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use dsa_indexer::cuda::{self, CudaBackend};
use dsa_indexer::problem::Problem;
use fuzz_common::case::{self, BackendRun, LogitBound, Spec, Subject};
use fuzz_common::STATS;
use libfuzzer_sys::fuzz_target;

struct Cuda(CudaBackend);

/// The precision under test: `$DSA_FUZZ_PRECISION` (`full`, the default, or `fast`).
fn precision() -> cuda::Precision {
    static P: std::sync::OnceLock<cuda::Precision> = std::sync::OnceLock::new();
    *P.get_or_init(|| {
        let name = std::env::var("DSA_FUZZ_PRECISION").unwrap_or_else(|_| "full".into());
        cuda::Precision::parse(&name).unwrap_or_else(|e| panic!("DSA_FUZZ_PRECISION: {e}"))
    })
}

/// The bound the backend states for its production kernels (no test hook) at the
/// precision under test.
fn production_bound(p: &Problem, i: usize, j: usize, m: f64) -> f64 {
    cuda::logit_bound(p, i, j, m, cuda::Hooks::default(), precision())
}

impl Subject for Cuda {
    fn run(&mut self, p: &Problem, budget: usize, _threads: u8) -> BackendRun {
        dsa_indexer::indexer::run(&mut self.0, p, budget)
    }
    fn logits(
        &mut self,
        p: &Problem,
        budget: usize,
        _threads: u8,
    ) -> Vec<(String, dsa_indexer::Result<Vec<f32>>)> {
        vec![("cuda".to_string(), self.0.logits(p, budget))]
    }
    fn bound(&self, p: &Problem) -> Option<LogitBound> {
        (!cuda::is_bitwise(p)).then_some(production_bound as LogitBound)
    }
}

thread_local! {
    static DEVICE: std::cell::RefCell<Cuda> = std::cell::RefCell::new(Cuda(
        CudaBackend::new()
            .unwrap_or_else(|e| panic!("cuda_vs_reference needs a CUDA GPU: {e}"))
            .with_precision(precision()),
    ));
}

fuzz_target!(|data: &[u8]| {
    STATS.input("cuda_vs_reference");
    let spec = Spec::arbitrary_take_rest(Unstructured::new(data)).expect("fixed-size fields");
    DEVICE.with(|d| case::check(&spec, &mut *d.borrow_mut()));
});
