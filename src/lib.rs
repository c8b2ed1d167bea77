//! # dsa-indexer
//!
//! The indexer of DeepSeek's sparse attention under a fixed memory budget. For every
//! query row `i` of a prefill batch and every earlier compressed key `j` of its request,
//!
//! ```text
//! logit[i, j] = sum_h  w[i, h] * relu( q[i, h, :] . k[j, :] )
//! ```
//!
//! with fp8 (E4M3) or fp4 (E2M1 + UE8M0 group scales) operands, summed in the exact
//! order of `docs/SPEC.md` section 4. Each row keeps its top-`K` keys (section 5), and a
//! source layer publishes coarse candidate blocks for later consumer layers (section 6).
//!
//! The [`reference`](mod@reference) is the oracle: the formulas as they read. The
//! [`indexer`] driver computes the same outputs in row tiles whose logits fit a byte
//! budget ([`plan`]).
//! A [`dump`] is one layer-forward in a file (SPEC 9); the [`verdict`] judges an
//! engine's dumped outputs against the reference.
//!
//! Features: `cli` (default) builds the `dsa-indexer` binary (`docs/cli.md`) with
//! its own dependencies (`clap`, `indicatif`, `rand`, `rand_chacha`); a library user
//! leaves it out with `default-features = false`. `cuda` adds the `cuda` module, the
//! NVIDIA backend (kernels compiled at run time by NVRTC).
//!
//! ```
//! use dsa_indexer::{batch::Batch, problem::*, reference};
//! use ndarray::{Array1, Array2, Array3};
//! // Two rows of one request (positions 0 and 1), H = 8 heads, D = 32, fp8 x fp8.
//! let batch = Batch::contiguous(&[2], &[0], 1).unwrap();
//! let q = Array3::from_elem((2, 8, 32), 0x38u8); // 1.0
//! let k = Array2::from_elem((2, 32), 0x38u8);
//! let kscale = Array1::from_elem(2, 1.0f32);
//! let w = Array2::from_elem((2, 8), 0.5f32);
//! let inputs = Inputs {
//!     q: Queries::E4m3(q.view()),
//!     k: Keys::E4m3 { codes: k.view(), scale: kscale.view() },
//!     weights: w.view(),
//!     k_slots: None,
//! };
//! let p = Problem::new(&batch, inputs, Params::new(1), Role::Plain).unwrap();
//! // Row 0 sees key 0; row 1 sees keys 0 and 1: each logit is 8 * 0.5 * 32 = 128.
//! assert_eq!(reference::logits(&p), vec![128.0, 128.0, 128.0]);
//! // A tie: the lower key wins.
//! assert_eq!(reference::run(&p).raw.row(1).to_vec(), vec![0]);
//! ```
#![deny(missing_docs)]

pub mod batch;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dump;
pub mod error;
pub mod formats;
pub mod indexer;
pub mod paged;
pub mod plan;
pub mod problem;
pub mod reference;
pub mod verdict;

pub use error::{Error, Result};
