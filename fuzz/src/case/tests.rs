//! Tests of the case itself: its byte layout round-trips, short inputs decode, and
//! the comparison accepts a recorded device result inside the stated bound.

use super::*;
use arbitrary::{Arbitrary, Unstructured};

#[test]
fn seeds_round_trip_through_arbitrary() {
    for (name, s) in seeds() {
        let b = s.to_bytes();
        let back = Spec::arbitrary_take_rest(Unstructured::new(&b)).unwrap();
        assert_eq!(back.to_bytes(), b, "{name}");
        assert_eq!(format!("{back:?}"), format!("{s:?}"), "{name}");
    }
}

/// `FUZZ_SPEC=<artifact> cargo test --manifest-path fuzz/Cargo.toml --release print_spec
/// -- --nocapture` prints a `chunked_vs_reference` / `cuda_vs_reference` input decoded.
#[test]
fn print_spec() {
    let Some(path) = std::env::var_os("FUZZ_SPEC") else {
        return;
    };
    let bytes = std::fs::read(path).unwrap();
    let s = Spec::arbitrary_take_rest(Unstructured::new(&bytes)).unwrap();
    println!(
        "{s:#?}\n{:#?}\nparams {:?} tail {:?} budgets {:?} defect {:?}",
        s.layout(),
        s.params(),
        s.tail(),
        s.budgets(),
        s.defect()
    );
}

/// fuzz/FINDINGS.md F3, without a GPU: the committed input
/// `corpus/cuda_vs_reference/regress_subnormal_kscale_bound` through [`check`] with
/// the H200's logits (the reference's, logit `[13, 0]` one subnormal ulp lower, as
/// the run recorded) passes under `cuda::logit_bound`, and that difference exceeds
/// the bound's relative part `2^TOLERANCE_LOG2 * M` alone.
#[cfg(feature = "cuda")]
#[test]
fn f3_subnormal_logit_is_within_the_cuda_bound() {
    use dsa_indexer::cuda;
    use dsa_indexer::problem::Problem;
    use dsa_indexer::reference;
    use dsa_indexer::Result;

    /// The reference's logits with the H200's logit `[13, 0]`; records
    /// `(device, reference, M, stated bound)` of that logit.
    struct H200F3(Vec<(f32, f32, f64, f64)>);
    impl H200F3 {
        fn logits_of(&mut self, p: &Problem) -> Vec<f32> {
            let mut l = reference::logits(p);
            let (i, j) = (13, 0);
            let x: usize = p.batch.rows()[..i].iter().map(|r| r.n).sum::<usize>() + j;
            let r = l[x];
            l[x] = f32::from_bits(r.to_bits() - 1);
            let m = magnitude(p, i, j);
            self.0.push((l[x], r, m, cuda::logit_bound(p, i, j, m)));
            l
        }
    }
    impl Subject for H200F3 {
        fn run(&mut self, p: &Problem, budget: usize, _threads: u8) -> BackendRun {
            let (_, plan) = dsa_indexer::indexer::run_cpu(p, budget)?;
            Ok((select_from_scores(p, &self.logits_of(p)), plan))
        }
        fn logits(
            &mut self,
            p: &Problem,
            _budget: usize,
            _threads: u8,
        ) -> Vec<(String, Result<Vec<f32>>)> {
            vec![("h200".into(), Ok(self.logits_of(p)))]
        }
        fn bound(&self, p: &Problem) -> Option<LogitBound> {
            (!cuda::is_bitwise(p)).then_some(cuda::logit_bound as LogitBound)
        }
    }

    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus/cuda_vs_reference/regress_subnormal_kscale_bound");
    let bytes = std::fs::read(path).unwrap();
    let spec = Spec::arbitrary_take_rest(Unstructured::new(&bytes)).unwrap();
    let mut dev = H200F3(Vec::new());
    check(&spec, &mut dev);
    assert!(!dev.0.is_empty(), "the case reached the comparison");
    for &(x, r, m, b) in &dev.0 {
        // FINDINGS.md: device 5.769e-42, reference 5.770e-42 (4117 and 4118 * 2^-149).
        assert_eq!((x.to_bits(), r.to_bits()), (0x1015, 0x1016));
        // The figures tests/cuda.rs checks without this file.
        assert_eq!(m, 2.5587764977137906e-41);
        let diff = r as f64 - x as f64;
        assert_eq!(diff, 2f64.powi(-149));
        assert!(
            2f64.powi(cuda::TOLERANCE_LOG2) * m < diff,
            "outside the old bound"
        );
        assert!(diff <= b, "inside the stated bound {b:e}");
    }
}

#[test]
fn short_inputs_decode_as_zero_padded() {
    let s = Spec::arbitrary_take_rest(Unstructured::new(&[])).unwrap();
    assert_eq!(s, Spec::default());
    let s = Spec::arbitrary_take_rest(Unstructured::new(&[49, 3])).unwrap();
    assert_eq!((s.corrupt, s.ratio, s.n_requests), (49, 3, 0));
}
