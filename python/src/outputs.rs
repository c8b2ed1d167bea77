//! The outputs a caller hands over to be judged (`check`'s `engine_*`) or written into
//! a dump (`save_dump`'s `expected_*`), read into the library's [`Expected`].

use dsa_indexer::dump::Expected;
use dsa_indexer::{Error, Result};
use ndarray::Array2;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::tensor::{bad, Tensor};
use crate::to_py;

const OUTPUT_KEYS: [&str; 8] = [
    "raw",
    "page",
    "published",
    "published_rows",
    "ks",
    "ke",
    "logits",
    "engine_logits",
];

/// An `int32` (or `int64`) tensor as `[rows, cols]`.
fn i32_2d(t: &Tensor) -> Result<Array2<i32>> {
    if t.shape.len() != 2 {
        return Err(t.error("int32 [rows, columns]"));
    }
    let v = t.i32s()?.as_slice().to_vec();
    Array2::from_shape_vec((t.shape[0], t.shape[1]), v).map_err(|e| bad(t.name, e.to_string()))
}

/// An `int32` (or `int64`) tensor of one dimension.
fn i32_1d(t: &Tensor) -> Result<Vec<i32>> {
    if t.shape.len() != 1 {
        return Err(t.error("int32 [rows]"));
    }
    Ok(t.i32s()?.as_slice().to_vec())
}

/// The names `check`'s arguments give the outputs, in [`OUTPUT_KEYS`]'s order.
pub(crate) const ENGINE_NAMES: [&str; 8] = [
    "engine_raw",
    "engine_page",
    "engine_published",
    "engine_published_rows",
    "engine_ks",
    "engine_ke",
    "engine_logits",
    "engine_logits",
];

/// The names `save_dump`'s arguments (and the dump schema) give them.
pub(crate) const DUMP_NAMES: [&str; 8] = [
    "expected_raw",
    "expected_page",
    "expected_published",
    "expected_published_rows",
    "expected_ks",
    "expected_ke",
    "expected_logits",
    "engine_logits",
];

/// Outputs to judge (or to write into a dump), keyed by the schema's names without
/// the `expected_` prefix: `raw`, `page`, `published`, `published_rows`, `ks`, `ke`,
/// `logits` (`[sum n]`, the reference's form) and `engine_logits` (`[T, L]`); errors
/// name them as `names` does.
pub(crate) fn outputs(
    d: &Bound<'_, PyDict>,
    names: &[&'static str; 8],
) -> PyResult<(Expected, Option<Array2<f32>>)> {
    let mut e = Expected::default();
    let mut engine = None;
    for (k, v) in d.iter() {
        if v.is_none() {
            continue;
        }
        let k: String = k.extract()?;
        let Some(i) = OUTPUT_KEYS.iter().position(|&n| n == k) else {
            return Err(to_py(bad(&k, "not an output the judge reads")));
        };
        let t = Tensor::import(names[i], &v)?;
        let r: Result<()> = (|| {
            match OUTPUT_KEYS[i] {
                "raw" => e.raw = Some(i32_2d(&t)?),
                "page" => e.page = Some(i32_2d(&t)?),
                "published" => e.published = Some(i32_2d(&t)?),
                "published_rows" => e.published_rows = Some(i32_1d(&t)?),
                "ks" => e.ks = Some(i32_1d(&t)?),
                "ke" => e.ke = Some(i32_1d(&t)?),
                "logits" => {
                    if t.shape.len() != 1 {
                        return Err(t.error("float32 [sum n]"));
                    }
                    e.logits = Some(t.floats()?.as_slice().to_vec());
                }
                _ => {
                    if t.shape.len() != 2 {
                        return Err(t.error("float32 [T, L]"));
                    }
                    let v = t.floats()?.as_slice().to_vec();
                    engine = Some(
                        Array2::from_shape_vec((t.shape[0], t.shape[1]), v)
                            .map_err(|err| bad(t.name, err.to_string()))?,
                    );
                }
            }
            Ok(())
        })();
        r.map_err(to_py)?;
    }
    Ok((e, engine))
}

/// A judge's error on an engine's outputs named as `check`'s arguments name them
/// (`engine_raw` where a dump has `expected_raw`).
pub(crate) fn engine_names(e: Error) -> Error {
    match e {
        Error::Dump { tensor, problem } => Error::Dump {
            tensor: match tensor.strip_prefix("expected_") {
                Some(t) => format!("engine_{t}"),
                None => tensor,
            },
            problem,
        },
        e => e,
    }
}
