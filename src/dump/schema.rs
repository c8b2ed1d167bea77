//! The dump's schema: its scalar metadata and its owned tensors, as types, and the
//! metadata keys both ways (`__metadata__` strings <-> [`Meta`]).

use std::collections::HashMap;

use ndarray::{Array1, Array2, Array3};

use super::derr;
use crate::error::Result;
use crate::problem::Format;

/// Which role the dumped layer played.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoleKind {
    /// Top-k only.
    Plain,
    /// Publishes candidate blocks.
    Source,
    /// Restricted to given candidate blocks.
    Consumer,
}

/// Scalar metadata of a dump (`__metadata__`).
#[derive(Debug, Clone, PartialEq)]
pub struct Meta {
    /// `H`.
    pub heads: usize,
    /// `D`.
    pub dim: usize,
    /// `K`.
    pub topk: usize,
    /// `r`.
    pub ratio: usize,
    /// Query format.
    pub q_format: Format,
    /// Key format.
    pub k_format: Format,
    /// Role.
    pub role: RoleKind,
    /// `B`.
    pub block_size: usize,
    /// `NB`.
    pub num_blocks: usize,
    /// Width of `page`.
    pub page_cols: Option<usize>,
    /// Tail-only publishing.
    pub tail: Option<usize>,
    /// Decode dumps: rows per request (`q0_b = S_b - next_n`), checked against the
    /// layout.
    pub next_n: Option<usize>,
    /// Free text.
    pub description: String,
}

#[cfg(test)]
impl Meta {
    /// A plain fp8 x fp8 layer's metadata, H = 8, D = 32, ratio 1, default blocks: the
    /// dump module's unit tests' small problem.
    pub(crate) fn plain_e4m3_h8_d32(topk: usize) -> Meta {
        Meta {
            heads: 8,
            dim: 32,
            topk,
            ratio: 1,
            q_format: Format::E4m3,
            k_format: Format::E4m3,
            role: RoleKind::Plain,
            block_size: 8,
            num_blocks: 2048,
            page_cols: None,
            tail: None,
            next_n: None,
            description: String::new(),
        }
    }
}

/// Query tensors, owned.
#[derive(Debug, Clone, PartialEq)]
pub enum QData {
    /// E4M3 `[T, H, D]`.
    E4m3(Array3<u8>),
    /// Packed E2M1 `[T, H, D/2]`, UE8M0 `[T, H, D/32]`.
    E2m1 {
        /// Packed codes.
        packed: Array3<u8>,
        /// Scale bytes.
        scale: Array3<u8>,
    },
}

/// Key tensors, owned.
#[derive(Debug, Clone, PartialEq)]
pub enum KData {
    /// E4M3 `[L, D]`, f32 scale `[L]`.
    E4m3 {
        /// Codes.
        codes: Array2<u8>,
        /// Per-key scale.
        scale: Array1<f32>,
    },
    /// Packed E2M1 `[L, D/2]`, UE8M0 `[L, D/32]`.
    E2m1 {
        /// Packed codes.
        packed: Array2<u8>,
        /// Scale bytes.
        scale: Array2<u8>,
    },
    /// Paged keys (SPEC 10) of the metadata's `k_format`: `kv_cache`, `page_table` and
    /// the metadata `page_size`.
    Paged {
        /// The pool, `u8 [num_pages, P * bytes_per_token]`.
        kv_cache: Array2<u8>,
        /// `i32 [B, max_pages]`.
        page_table: Array2<i32>,
        /// `P`.
        page_size: usize,
    },
}

/// How rows are given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// `query_starts [B]`.
    Contiguous(Vec<usize>),
    /// `row_requests [T]`, `row_positions [T]`.
    Explicit {
        /// Request of each row.
        requests: Vec<usize>,
        /// Position of each row.
        positions: Vec<usize>,
    },
}

/// Expected (or engine-produced) outputs carried by a dump.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Expected {
    /// `ks [T]`.
    pub ks: Option<Vec<i32>>,
    /// `ke [T]`.
    pub ke: Option<Vec<i32>>,
    /// Visible logits, rows concatenated `[sum n]`.
    pub logits: Option<Vec<f32>>,
    /// `raw [T, K]`.
    pub raw: Option<Array2<i32>>,
    /// `page [T, page_cols]`.
    pub page: Option<Array2<i32>>,
    /// `published [P, NB]`.
    pub published: Option<Array2<i32>>,
    /// `published_rows [P]`.
    pub published_rows: Option<Vec<i32>>,
}

/// One layer-forward, owned.
#[derive(Debug, Clone, PartialEq)]
pub struct Dump {
    /// Scalars.
    pub meta: Meta,
    /// `S_b`.
    pub seq_lens: Vec<usize>,
    /// Rows.
    pub layout: Layout,
    /// Queries.
    pub q: QData,
    /// Keys.
    pub k: KData,
    /// `w [T, H]`.
    pub weights: Array2<f32>,
    /// `k_slots [L]`.
    pub k_slots: Option<Array1<i32>>,
    /// Consumer input `[T, NB]`.
    pub candidates: Option<Array2<i32>>,
    /// The engine's own logits over the flat key buffer, `[T, L]`; only `[ks, ke)` is meaningful.
    pub engine_logits: Option<Array2<f32>>,
    /// Expected outputs.
    pub expected: Expected,
}

pub(super) fn meta_num(m: &HashMap<String, String>, key: &str) -> Result<Option<usize>> {
    match m.get(key) {
        None => Ok(None),
        Some(s) => s.trim().parse::<usize>().map(Some).map_err(|_| {
            derr(
                "__metadata__",
                format!("{key} = {s:?}, expected a non-negative integer"),
            )
        }),
    }
}

fn meta_req(m: &HashMap<String, String>, key: &str) -> Result<usize> {
    meta_num(m, key)?.ok_or_else(|| derr("__metadata__", format!("{key} missing")))
}

fn format_of(m: &HashMap<String, String>, key: &str) -> Result<Format> {
    match m.get(key).map(|s| s.as_str()) {
        Some("e4m3") => Ok(Format::E4m3),
        Some("e2m1") => Ok(Format::E2m1),
        other => Err(derr(
            "__metadata__",
            format!("{key} = {other:?}, expected \"e4m3\" or \"e2m1\""),
        )),
    }
}

impl Meta {
    /// The metadata of a file's `__metadata__` map.
    pub(super) fn parse(m: &HashMap<String, String>) -> Result<Meta> {
        let role = match m.get("role").map(|s| s.as_str()) {
            None | Some("plain") => RoleKind::Plain,
            Some("source") => RoleKind::Source,
            Some("consumer") => RoleKind::Consumer,
            Some(o) => {
                return Err(derr(
                    "__metadata__",
                    format!("role = {o:?}, expected plain, source or consumer"),
                ))
            }
        };
        Ok(Meta {
            heads: meta_req(m, "heads")?,
            dim: meta_req(m, "dim")?,
            topk: meta_req(m, "topk")?,
            ratio: meta_req(m, "ratio")?,
            q_format: format_of(m, "q_format")?,
            k_format: format_of(m, "k_format")?,
            role,
            block_size: meta_num(m, "block_size")?.unwrap_or(8),
            num_blocks: meta_num(m, "num_blocks")?.unwrap_or(2048),
            page_cols: meta_num(m, "page_cols")?,
            tail: meta_num(m, "tail")?,
            next_n: meta_num(m, "next_n")?,
            description: m.get("description").cloned().unwrap_or_default(),
        })
    }

    /// The `__metadata__` map of the metadata.
    pub(super) fn to_map(&self) -> HashMap<String, String> {
        let mut m = HashMap::new();
        let mut put = |k: &str, v: String| {
            m.insert(k.to_string(), v);
        };
        put("heads", self.heads.to_string());
        put("dim", self.dim.to_string());
        put("topk", self.topk.to_string());
        put("ratio", self.ratio.to_string());
        put("q_format", self.q_format.to_string());
        put("k_format", self.k_format.to_string());
        put(
            "cls",
            if (self.q_format, self.k_format) == (Format::E2m1, Format::E2m1) {
                "exact"
            } else {
                "tolerance"
            }
            .into(),
        );
        put(
            "role",
            match self.role {
                RoleKind::Plain => "plain",
                RoleKind::Source => "source",
                RoleKind::Consumer => "consumer",
            }
            .into(),
        );
        put("block_size", self.block_size.to_string());
        put("num_blocks", self.num_blocks.to_string());
        if let Some(c) = self.page_cols {
            put("page_cols", c.to_string());
        }
        if let Some(t) = self.tail {
            put("tail", t.to_string());
        }
        if let Some(n) = self.next_n {
            put("next_n", n.to_string());
        }
        put("description", self.description.clone());
        m
    }
}
