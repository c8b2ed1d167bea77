//! The backend under test ([`Subject`]), its stated logit bound, and the CPU backend
//! on small rayon pools.

use dsa_indexer::plan::Plan;
use dsa_indexer::problem::Problem;
use dsa_indexer::reference::Output;
use dsa_indexer::Result;

/// What a backend run returns.
pub type BackendRun = Result<(Output, Plan)>;

/// A backend under test.
pub trait Subject {
    /// The chunked driver on this backend under `budget` (`threads`: a hint for CPU pools).
    fn run(&mut self, p: &Problem, budget: usize, threads: u8) -> BackendRun;
    /// The backend's logits as it computes them under `budget`, rows concatenated
    /// (the layout of `reference::logits`), once per variant (an ISA, a device).
    fn logits(
        &mut self,
        p: &Problem,
        budget: usize,
        threads: u8,
    ) -> Vec<(String, Result<Vec<f32>>)>;
    /// `None`: logits are held bitwise. `Some(b)`: logit `[i, j]` within
    /// `b(p, i, j, M)` of the reference's (SPEC 4's `M`, from
    /// [`magnitude`](super::magnitude)), non-finite ones equal to it, and the outputs
    /// must then meet SPEC 5's rule on the reference's scores
    /// ([`check_selection`](super::check_selection)) and be the reference's selection
    /// from the backend's own logits.
    fn bound(&self, p: &Problem) -> Option<LogitBound>;
}

/// A backend's stated bound on `|x - ref|` for logit `[i, j]` of a problem, given that
/// logit's SPEC 4 magnitude `M` (e.g. `dsa_indexer::cuda::logit_bound`).
pub type LogitBound = fn(&Problem, usize, usize, f64) -> f64;

/// The CPU backend: driver on a pool of `1 + threads % 3` rayon threads, logits of
/// every instruction set this CPU has, all bitwise.
#[derive(Debug, Default)]
pub struct Cpu;

impl Subject for Cpu {
    fn run(&mut self, p: &Problem, budget: usize, threads: u8) -> BackendRun {
        on_pool(threads, || dsa_indexer::indexer::run_cpu(p, budget))
    }
    fn logits(
        &mut self,
        p: &Problem,
        _budget: usize,
        threads: u8,
    ) -> Vec<(String, Result<Vec<f32>>)> {
        dsa_indexer::cpu::Isa::available()
            .into_iter()
            .map(|isa| {
                let l = on_pool(threads, || dsa_indexer::cpu::engine_logits(p, isa));
                (isa.name().to_string(), Ok(l))
            })
            .collect()
    }
    fn bound(&self, _p: &Problem) -> Option<LogitBound> {
        None
    }
}

fn pools() -> &'static [rayon::ThreadPool] {
    static POOLS: std::sync::OnceLock<Vec<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOLS.get_or_init(|| {
        (1..=3)
            .map(|n| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .expect("a rayon pool")
            })
            .collect()
    })
}

/// Run `f` on a pool of `1 + threads % 3` rayon threads.
pub fn on_pool<R: Send>(threads: u8, f: impl FnOnce() -> R + Send) -> R {
    pools()[(threads % 3) as usize].install(f)
}
