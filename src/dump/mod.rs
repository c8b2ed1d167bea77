//! Layer-forward dumps (SPEC 9): the golden schema of `tests/golden/README.md`, read
//! and written with the `safetensors` crate. Accepts the dtypes a PyTorch user has.
//!
//! - [`schema`]: the types ([`Dump`], [`Meta`], [`QData`], [`KData`], [`Layout`],
//!   [`Expected`]) and the metadata keys;
//! - `read`: [`Dump::from_bytes`], every problem an [`Error::Dump`] naming the tensor;
//! - `write`: [`Dump::to_bytes`], equal dumps to equal bytes;
//! - `rows`: [`Dump::select_rows`], a dump cut to some of its rows.
//!
//! The schema itself, tensor by tensor, is in `docs/cli.md`.

mod read;
mod rows;
pub mod schema;
mod write;

pub use rows::{kept_rows, replay_budget};
pub use schema::{Dump, Expected, KData, Layout, Meta, QData, RoleKind};

use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::problem::{Inputs, Keys, Params, Problem, Published, Queries, Role};

/// An [`Error::Dump`] naming `tensor`.
pub(crate) fn derr(tensor: &str, problem: impl Into<String>) -> Error {
    Error::Dump {
        tensor: tensor.into(),
        problem: problem.into(),
    }
}

impl Dump {
    /// The batch of the dump.
    pub fn batch(&self) -> Result<Batch> {
        match &self.layout {
            Layout::Contiguous(q0) => {
                // Rows are materialised: check the count against `q` first, so that a
                // small file with a huge `seq_lens` is an error, not a huge allocation.
                let t = match &self.q {
                    QData::E4m3(q) => q.shape()[0],
                    QData::E2m1 { packed, .. } => packed.shape()[0],
                };
                let rows = self
                    .seq_lens
                    .iter()
                    .zip(q0)
                    .try_fold(0usize, |a, (&s, &q)| a.checked_add(s.saturating_sub(q)));
                if rows != Some(t) {
                    return Err(derr(
                        "query_starts",
                        format!(
                            "seq_lens - query_starts sum to {} rows, q has {t}",
                            rows.map_or("more than usize::MAX".into(), |r| r.to_string())
                        ),
                    ));
                }
                Batch::contiguous(&self.seq_lens, q0, self.meta.ratio)
            }
            Layout::Explicit {
                requests,
                positions,
            } => Batch::explicit(&self.seq_lens, requests, positions, self.meta.ratio),
        }
    }

    /// A consumer's candidates for `batch`, row `i` for row `i`.
    pub fn published_input(&self, batch: &Batch) -> Option<Published> {
        self.candidates
            .as_ref()
            .map(|c| Published::for_batch(batch, self.meta.block_size, c.clone()))
    }

    /// Layer parameters.
    pub fn params(&self) -> Params {
        Params {
            topk: self.meta.topk,
            page_cols: self.meta.page_cols,
            block_size: self.meta.block_size,
            num_blocks: self.meta.num_blocks,
        }
    }

    /// Views of the inputs.
    pub fn inputs(&self) -> Inputs<'_> {
        Inputs {
            q: match &self.q {
                QData::E4m3(q) => Queries::E4m3(q.view()),
                QData::E2m1 { packed, scale } => Queries::E2m1 {
                    packed: packed.view(),
                    scale: scale.view(),
                },
            },
            k: match &self.k {
                KData::E4m3 { codes, scale } => Keys::E4m3 {
                    codes: codes.view(),
                    scale: scale.view(),
                },
                KData::E2m1 { packed, scale } => Keys::E2m1 {
                    packed: packed.view(),
                    scale: scale.view(),
                },
                KData::Paged {
                    kv_cache,
                    page_table,
                    page_size,
                } => Keys::Paged(crate::paged::PagedKeys {
                    format: self.meta.k_format,
                    kv_cache: kv_cache.view(),
                    page_table: page_table.view(),
                    page_size: *page_size,
                }),
            },
            weights: self.weights.view(),
            k_slots: self.k_slots.as_ref().map(|s| s.view()),
        }
    }

    /// The validated problem (`published` from [`Dump::published_input`] for consumers).
    pub fn problem<'a>(
        &'a self,
        batch: &'a Batch,
        published: Option<&'a Published>,
    ) -> Result<Problem<'a>> {
        let role = match (self.meta.role, published) {
            (RoleKind::Plain, _) => Role::Plain,
            (RoleKind::Source, _) => Role::Source {
                tail: self.meta.tail,
            },
            (RoleKind::Consumer, Some(p)) => Role::Consumer(p),
            (RoleKind::Consumer, None) => {
                return Err(derr("candidates", "missing (role = consumer)"))
            }
        };
        let p = Problem::new(batch, self.inputs(), self.params(), role)?;
        if p.heads != self.meta.heads || p.dim != self.meta.dim {
            return Err(derr(
                "q",
                format!("H = {}, D = {} disagree with the metadata", p.heads, p.dim),
            ));
        }
        Ok(p)
    }
}
