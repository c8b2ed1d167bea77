//! SPEC 9's tolerance of an engine's selections: which one applies ([`Tolerance`],
//! [`Applied`]), and each differing row's margin ([`RowMargin`], [`MarginSummary`]).
//!
//! A row's tolerance bounds the gap between a score and the row's `K`-th score (SPEC
//! 5's rule). It is `2^x * M_i`, with `M_i` the row's largest SPEC 4 magnitude over
//! its visible keys, or twice the row's measured logit error when the dump carries the
//! engine's logits. A row's margin is the tightest tolerance under which it would pass,
//! as `log2` of its factor of `M_i`.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use super::{RowTol, Status};
use crate::error::{Error, Result};
use crate::problem::Class;

/// The default tolerance of the tolerance class's engine dumps without engine logits,
/// `2^-13 * M_i`: four times the largest per-score error measured on DeepGEMM's fp8
/// logits, twice that of the two scores a swap moves (`docs/numerics.md`, section 7).
pub const DEFAULT_TOLERANCE_LOG2: f64 = -13.0;

/// The tolerance a judge applies to selections.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Tolerance {
    /// Twice each row's measured logit error when the dump carries `engine_logits`;
    /// otherwise the class's default (exact class: exact ties only; tolerance class:
    /// [`DEFAULT_TOLERANCE_LOG2`], `2^-13 * M_i`).
    #[default]
    Auto,
    /// Exact ties only.
    Ties,
    /// `2^x * M_i` (`x <= 0`, finite).
    Pow2(f64),
}

impl Tolerance {
    /// `2^x * M_i`, or an error naming `tolerance` when `x` is not finite or above 0.
    pub fn pow2(x: f64) -> Result<Tolerance> {
        if x.is_finite() && x <= 0.0 {
            Ok(Tolerance::Pow2(x))
        } else {
            Err(bad_tolerance(&format!("2^{x}")))
        }
    }
}

fn bad_tolerance(v: &str) -> Error {
    Error::OutOfRange {
        field: "tolerance".into(),
        value: v.into(),
        expected: "`auto`, `0` (exact ties only) or `2^X` with X <= 0 (e.g. `2^-13`)",
    }
}

/// `auto`, `0` or `ties`, `2^X`.
impl FromStr for Tolerance {
    type Err = Error;
    fn from_str(s: &str) -> Result<Tolerance> {
        let t = s.trim();
        match t {
            "auto" => Ok(Tolerance::Auto),
            "0" | "ties" => Ok(Tolerance::Ties),
            _ => {
                let x = t
                    .strip_prefix("2^")
                    .and_then(|e| e.trim().parse::<f64>().ok())
                    .ok_or_else(|| bad_tolerance(s))?;
                Tolerance::pow2(x).map_err(|_| bad_tolerance(s))
            }
        }
    }
}

impl fmt::Display for Tolerance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tolerance::Auto => f.write_str("auto"),
            Tolerance::Ties => f.write_str("0"),
            Tolerance::Pow2(x) => write!(f, "{}", pow2(*x)),
        }
    }
}

/// `2^-13`, `2^-8.3`: a power of two to one decimal of its exponent.
pub fn pow2(x: f64) -> String {
    if x == x.round() {
        format!("2^{x:.0}")
    } else {
        format!("2^{x:.1}")
    }
}

/// The tolerance a judgement applied to selections, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Applied {
    /// `measured` (from `engine_logits`), `default` (the class's) or `given`.
    pub source: &'static str,
    /// The rule: `2^-13 M`, `exact ties only`, `2 x max |x - ref| over the row's keys`.
    pub rule: String,
    /// `log2` of the factor of `M_i` (measured: the largest over the rows); `None`
    /// for exact ties only.
    pub log2: Option<f64>,
    /// Why this one.
    pub why: String,
}

impl fmt::Display for Applied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}: {})", self.rule, self.source, self.why)
    }
}

/// The class's default for engine dumps without engine logits (`None`: exact ties).
pub(crate) fn default_log2(c: Class) -> Option<f64> {
    match c {
        Class::Exact => None,
        Class::Tolerance => Some(DEFAULT_TOLERANCE_LOG2),
    }
}

/// The applied tolerance of the exact top-k check against the engine's own logits.
pub(crate) fn exact_ties() -> Applied {
    Applied {
        source: "default",
        rule: "exact ties only".into(),
        log2: None,
        why: "the engine's selections are SPEC 5's selection of its own logits".into(),
    }
}

/// The row tolerance and its description for `t`; `measured` holds each row's largest
/// `|x - ref|` over its visible keys and the row's `M` (0 where the row's logits are
/// bitwise the reference's), when the dump carries engine logits.
pub(crate) fn resolve(
    t: Tolerance,
    class: Class,
    measured: Option<Vec<(f64, f64)>>,
) -> (RowTol, Applied) {
    let given = |rule: String, log2| Applied {
        source: "given",
        rule,
        log2,
        why: "set by the caller (--tolerance, tolerance=)".into(),
    };
    match (t, measured) {
        (Tolerance::Ties, _) => (RowTol::Ties, given("exact ties only".into(), None)),
        (Tolerance::Pow2(x), _) => (
            RowTol::Relative(x),
            given(format!("{} M", pow2(x)), Some(x)),
        ),
        (Tolerance::Auto, Some(err)) => {
            let log2 = err
                .iter()
                .filter(|&&(e, m)| e > 0.0 && m > 0.0)
                .map(|&(e, m)| (2.0 * e / m).log2())
                .fold(None, |a: Option<f64>, x| Some(a.map_or(x, |a| a.max(x))));
            (
                RowTol::Measured(err.iter().map(|&(e, _)| 2.0 * e).collect()),
                Applied {
                    source: "measured",
                    rule: "2 x max |x - ref| over the row's visible keys".into(),
                    log2,
                    why: "the dump carries engine_logits: twice each row's measured logit \
                          error (two scores move)"
                        .into(),
                },
            )
        }
        (Tolerance::Auto, None) => match default_log2(class) {
            None => (
                RowTol::Ties,
                Applied {
                    source: "default",
                    rule: "exact ties only".into(),
                    log2: None,
                    why: "exact class without engine_logits: an engine's logits are bitwise \
                          the reference's"
                        .into(),
                },
            ),
            Some(x) => (
                RowTol::Relative(x),
                Applied {
                    source: "default",
                    rule: format!("{} M", pow2(x)),
                    log2: Some(x),
                    why: "tolerance class without engine_logits: the default for engine \
                          dumps (docs/numerics.md)"
                        .into(),
                },
            ),
        },
    }
}

/// One differing row's margin: the tightest tolerance under which it would pass.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RowMargin {
    /// The row, in the caller's numbering.
    pub row: usize,
    /// Its status under the applied tolerance.
    pub status: Status,
    /// `log2(need / M_i)`: it passes under `2^x * M_i` for every `x` at least this.
    /// `None`: it needs none (equal up to ties), or no tolerance passes it (a wrong
    /// count, a non-candidate, a malformed row: then `status` is different).
    pub needs_log2: Option<f64>,
    /// The applied tolerance as `log2` of its factor of `M_i` (`None`: exact ties).
    pub tolerance_log2: Option<f64>,
}

fn finite_log2(x: f64) -> Option<f64> {
    let l = x.log2();
    l.is_finite().then_some(l)
}

impl RowMargin {
    /// Row `row` with `status`; `need` the tightest tolerance (`None`: none passes),
    /// `tau` the applied one, `m` the row's `M`.
    pub(crate) fn new(row: usize, status: Status, need: Option<f64>, tau: f64, m: f64) -> Self {
        RowMargin {
            row,
            status,
            needs_log2: need.and_then(|n| finite_log2(n / m)),
            tolerance_log2: finite_log2(tau / m),
        }
    }

    /// `, needs 2^-8.3 M (tolerance 2^-13 M)`, or what stands for it.
    pub fn describe(&self) -> String {
        let tol = match self.tolerance_log2 {
            Some(t) => format!("tolerance {} M", pow2(t)),
            None => "tolerance: exact ties".into(),
        };
        match (self.status, self.needs_log2) {
            (Status::Ties, _) => String::new(),
            (_, Some(x)) => format!(", needs {} M ({tol})", pow2(x)),
            (_, None) => ", no tolerance passes it".into(),
        }
    }
}

/// The distribution of a part's margins, so that one outlier stands out.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MarginSummary {
    /// Differing rows.
    pub rows: usize,
    /// Rows equal only up to ties.
    pub ties: usize,
    /// Rows no tolerance passes.
    pub unfixable: usize,
    /// The largest `needs_log2`.
    pub worst_log2: Option<f64>,
    /// Its row.
    pub worst_row: Option<usize>,
    /// The median `needs_log2` of the rows that need a tolerance.
    pub median_log2: Option<f64>,
    /// The class's default (`None`: exact ties only).
    pub default_log2: Option<f64>,
    /// Rows that the default would not pass (the unfixable ones included).
    pub beyond_default: usize,
}

impl MarginSummary {
    /// The summary of `margins` (`None` when there are none).
    pub(crate) fn of(margins: &[RowMargin], default_log2: Option<f64>) -> Option<Self> {
        if margins.is_empty() {
            return None;
        }
        let ties = margins.iter().filter(|m| m.status == Status::Ties).count();
        let unfixable = margins
            .iter()
            .filter(|m| m.status != Status::Ties && m.needs_log2.is_none())
            .count();
        let mut needs: Vec<(f64, usize)> = margins
            .iter()
            .filter_map(|m| m.needs_log2.map(|x| (x, m.row)))
            .collect();
        needs.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
        let worst = needs.last().copied();
        let median = (!needs.is_empty()).then(|| needs[needs.len() / 2].0);
        let beyond = needs
            .iter()
            .filter(|&&(x, _)| default_log2.is_none_or(|d| x > d))
            .count();
        Some(MarginSummary {
            rows: margins.len(),
            ties,
            unfixable,
            worst_log2: worst.map(|w| w.0),
            worst_row: worst.map(|w| w.1),
            median_log2: median,
            default_log2,
            beyond_default: beyond + unfixable,
        })
    }
}

impl fmt::Display for MarginSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = match self.default_log2 {
            Some(x) => format!("{} M", pow2(x)),
            None => "exact ties".into(),
        };
        write!(f, "margins of {} differing rows:", self.rows)?;
        if let (Some(w), Some(r), Some(m)) = (self.worst_log2, self.worst_row, self.median_log2) {
            write!(
                f,
                " worst needs {} M (row {r}), median {} M,",
                pow2(w),
                pow2(m)
            )?;
        }
        if self.ties > 0 {
            write!(f, " {} up to ties,", self.ties)?;
        }
        if self.unfixable > 0 {
            write!(f, " {} under no tolerance,", self.unfixable)?;
        }
        write!(f, " {} beyond the default {d}", self.beyond_default)
    }
}

/// A logit part's worst error in one row.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RowError {
    /// The row, in the caller's numbering.
    pub row: usize,
    /// `log2` of the row's largest `|x - ref| / M_j` (`+inf`, shown as `null`, for a
    /// non-finite value against a finite one or the other infinity).
    pub error_log2: f64,
    /// The key (request-local) where it is.
    pub key: usize,
}
