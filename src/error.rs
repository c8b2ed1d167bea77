//! The crate's one error type. Every variant names the offending field and value.

use thiserror::Error;

/// Everything that can go wrong, as a value. Library code never panics on input.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum Error {
    /// A scalar parameter lies outside its allowed set.
    #[error("{field} = {value}: {expected}")]
    OutOfRange {
        /// The offending field, e.g. `heads` or `seq_lens[3]`.
        field: String,
        /// The value as given.
        value: String,
        /// What would have been accepted.
        expected: &'static str,
    },
    /// An array does not have the shape the other inputs imply.
    #[error("{field}: shape {got:?}, expected {expected:?}")]
    Shape {
        /// The offending tensor.
        field: String,
        /// The shape given.
        got: Vec<usize>,
        /// The shape expected.
        expected: Vec<usize>,
    },
    /// An E4M3 byte is one of the two NaN codes (`0x7F`, `0xFF`).
    #[error("{field}[{index}] = 0x{byte:02x}: E4M3 NaN code is not a valid input")]
    NanE4m3 {
        /// The offending tensor.
        field: String,
        /// Flat element index.
        index: usize,
        /// The byte.
        byte: u8,
    },
    /// A UE8M0 scale byte is 255 (reserved).
    #[error("{field}[{index}] = 255: UE8M0 byte 255 is reserved")]
    ReservedScale {
        /// The offending tensor.
        field: String,
        /// Flat element index.
        index: usize,
    },
    /// A float that must be finite (and possibly positive) is not.
    #[error("{field}[{index}] = {value}: {expected}")]
    BadFloat {
        /// The offending tensor.
        field: String,
        /// Flat element index.
        index: usize,
        /// The value.
        value: f32,
        /// What would have been accepted.
        expected: &'static str,
    },
    /// A size computation overflows `usize`.
    #[error("{field}: size overflows usize")]
    Overflow {
        /// What was being sized.
        field: String,
    },
    /// Consumer candidates do not match the consumer's batch.
    #[error("candidates: {field} = {value}, expected {expected}")]
    CandidateMismatch {
        /// Which part differs (`rows`, `row[i].request`, `width`, ...).
        field: String,
        /// What the candidates carry.
        value: String,
        /// What the consumer's batch implies.
        expected: String,
    },
    /// A dump file is missing a tensor, has the wrong dtype, or is corrupt.
    #[error("dump: tensor `{tensor}`: {problem}")]
    Dump {
        /// The tensor (or `header`).
        tensor: String,
        /// What is wrong, and what was expected.
        problem: String,
    },
    /// A backend could not run (no device, compile failure, launch failure).
    #[error("backend {backend}: {problem}")]
    Backend {
        /// The backend (`cuda`, ...).
        backend: &'static str,
        /// What failed.
        problem: String,
    },
}

/// Result with the crate's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn range(
        field: impl Into<String>,
        value: impl ToString,
        expected: &'static str,
    ) -> Self {
        Error::OutOfRange {
            field: field.into(),
            value: value.to_string(),
            expected,
        }
    }
    pub(crate) fn shape(field: impl Into<String>, got: &[usize], expected: &[usize]) -> Self {
        Error::Shape {
            field: field.into(),
            got: got.to_vec(),
            expected: expected.to_vec(),
        }
    }
    pub(crate) fn overflow(field: impl Into<String>) -> Self {
        Error::Overflow {
            field: field.into(),
        }
    }

    // SPEC 8's value errors, built in one place for [`crate::problem::Problem::new`]'s
    // host checks and the CUDA backend's device-input checks, which must agree.

    /// `field[index]` holds an E4M3 NaN code.
    pub(crate) fn nan_e4m3(field: &str, index: usize, byte: u8) -> Self {
        Error::NanE4m3 {
            field: field.into(),
            index,
            byte,
        }
    }
    /// `field[index]` is the reserved UE8M0 byte 255.
    pub(crate) fn reserved_scale(field: &str, index: usize) -> Self {
        Error::ReservedScale {
            field: field.into(),
            index,
        }
    }
    /// Per-key scale `k_scale[index]` is not finite and positive.
    pub(crate) fn bad_key_scale(index: usize, value: f32) -> Self {
        Error::BadFloat {
            field: "k_scale".into(),
            index,
            value,
            expected: "finite and > 0",
        }
    }
    /// Weight `weights[index]` (flat) is not finite.
    pub(crate) fn bad_weight(index: usize, value: f32) -> Self {
        Error::BadFloat {
            field: "weights".into(),
            index,
            value,
            expected: "finite",
        }
    }
    /// Pool slot `k_slots[index]` is negative.
    pub(crate) fn negative_slot(index: usize, value: i32) -> Self {
        Error::range(format!("k_slots[{index}]"), value, "a slot >= 0")
    }
}

/// `a * b`, or an overflow error naming `field`.
pub(crate) fn mul(a: usize, b: usize, field: &str) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| Error::overflow(field))
}

/// `a + b`, or an overflow error naming `field`.
pub(crate) fn add(a: usize, b: usize, field: &str) -> Result<usize> {
    a.checked_add(b).ok_or_else(|| Error::overflow(field))
}
