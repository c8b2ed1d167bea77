//! Batch layout (SPEC 3): requests -> query rows, visible key counts, key offsets.

use crate::error::{add, Error, Result};

/// One request of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// `S_b`: tokens the request has after this step.
    pub seq_len: usize,
    /// `lc_b = S_b / r`: compressed keys.
    pub keys: usize,
    /// `L_off_b`: flat offset of the request's first key.
    pub key_offset: usize,
}

/// One query row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    /// Index of the row's request.
    pub request: usize,
    /// Token position `p < S_b`.
    pub position: usize,
    /// Visible keys `n = (p + 1) / r`.
    pub n: usize,
    /// `ks`: flat index of the request's first key.
    pub ks: usize,
}

impl Row {
    /// The row at position `p` of request `b` (`r`, its entry in the batch) under
    /// compression ratio `ratio`: it sees the keys `j < (p + 1) / ratio` (SPEC 3).
    fn at(b: usize, r: &Request, p: usize, ratio: usize) -> Row {
        Row {
            request: b,
            position: p,
            n: (p + 1) / ratio,
            ks: r.key_offset,
        }
    }

    /// `ke = ks + n`: end of the visible keys in the flat key buffer.
    pub fn ke(&self) -> usize {
        self.ks + self.n
    }
}

/// A validated batch: requests, rows, and the compression ratio.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    ratio: usize,
    requests: Vec<Request>,
    rows: Vec<Row>,
    /// `query_starts` when the batch was given in the contiguous layout.
    query_starts: Option<Vec<usize>>,
}

fn requests(seq_lens: &[usize], ratio: usize) -> Result<Vec<Request>> {
    if ratio == 0 {
        return Err(Error::range("ratio", 0, "ratio >= 1"));
    }
    let mut off = 0usize;
    let mut out = Vec::with_capacity(seq_lens.len());
    for &s in seq_lens {
        let keys = s / ratio;
        out.push(Request {
            seq_len: s,
            keys,
            key_offset: off,
        });
        off = add(off, keys, "total keys L")?;
    }
    Ok(out)
}

impl Batch {
    /// Contiguous layout: request `b`'s rows are positions `query_starts[b] .. seq_lens[b]`.
    pub fn contiguous(seq_lens: &[usize], query_starts: &[usize], ratio: usize) -> Result<Self> {
        if query_starts.len() != seq_lens.len() {
            return Err(Error::shape(
                "query_starts",
                &[query_starts.len()],
                &[seq_lens.len()],
            ));
        }
        let reqs = requests(seq_lens, ratio)?;
        let mut total = 0usize;
        for (b, (&s, &q0)) in seq_lens.iter().zip(query_starts).enumerate() {
            if q0 > s {
                return Err(Error::range(
                    format!("query_starts[{b}]"),
                    q0,
                    "query_start <= seq_len",
                ));
            }
            total = add(total, s - q0, "rows T")?;
        }
        // Rows are materialised: refuse sizes that cannot be allocated.
        if total > isize::MAX as usize / std::mem::size_of::<Row>() {
            return Err(Error::overflow("rows T"));
        }
        let mut rows = Vec::new();
        rows.try_reserve_exact(total)
            .map_err(|_| Error::overflow("rows T"))?;
        for (b, (r, &q0)) in reqs.iter().zip(query_starts).enumerate() {
            rows.extend((q0..r.seq_len).map(|p| Row::at(b, r, p, ratio)));
        }
        Ok(Batch {
            ratio,
            requests: reqs,
            rows,
            query_starts: Some(query_starts.to_vec()),
        })
    }

    /// Explicit layout: row `i` is position `row_positions[i]` of request `row_requests[i]`.
    pub fn explicit(
        seq_lens: &[usize],
        row_requests: &[usize],
        row_positions: &[usize],
        ratio: usize,
    ) -> Result<Self> {
        if row_positions.len() != row_requests.len() {
            return Err(Error::shape(
                "row_positions",
                &[row_positions.len()],
                &[row_requests.len()],
            ));
        }
        let reqs = requests(seq_lens, ratio)?;
        let mut rows = Vec::new();
        rows.try_reserve_exact(row_requests.len())
            .map_err(|_| Error::overflow("rows T"))?;
        for (i, (&b, &p)) in row_requests.iter().zip(row_positions).enumerate() {
            let r = reqs.get(b).ok_or_else(|| {
                Error::range(
                    format!("row_requests[{i}]"),
                    b,
                    "a request index < number of requests",
                )
            })?;
            if p >= r.seq_len {
                return Err(Error::range(
                    format!("row_positions[{i}]"),
                    p,
                    "position < seq_len of its request",
                ));
            }
            rows.push(Row::at(b, r, p, ratio));
        }
        Ok(Batch {
            ratio,
            requests: reqs,
            rows,
            query_starts: None,
        })
    }

    /// Compression ratio `r`.
    pub fn ratio(&self) -> usize {
        self.ratio
    }
    /// The requests.
    pub fn requests(&self) -> &[Request] {
        &self.requests
    }
    /// The query rows, in order.
    pub fn rows(&self) -> &[Row] {
        &self.rows
    }
    /// `T`: number of rows.
    pub fn num_rows(&self) -> usize {
        self.rows.len()
    }
    /// `L`: total keys.
    pub fn num_keys(&self) -> usize {
        self.requests.last().map_or(0, |r| r.key_offset + r.keys)
    }
    /// `seq_lens`.
    pub fn seq_lens(&self) -> Vec<usize> {
        self.requests.iter().map(|r| r.seq_len).collect()
    }
    /// `query_starts`, when the batch is contiguous.
    pub fn query_starts(&self) -> Option<&[usize]> {
        self.query_starts.as_deref()
    }
    /// The most keys a row sees: `max n` over rows (0 without rows).
    pub fn longest_row(&self) -> usize {
        self.rows.iter().map(|r| r.n).max().unwrap_or(0)
    }
    /// `sum n` over rows: the number of (row, visible key) pairs.
    pub fn valid_pairs(&self) -> usize {
        self.rows
            .iter()
            .map(|r| r.n)
            .fold(0usize, |a, n| a.saturating_add(n))
    }
    /// The batch of the layers after a source that publishes only the last `tail`
    /// positions of each request: rows with `p >= S_b - tail`, in order.
    pub fn tail(&self, tail: usize) -> Result<Batch> {
        if tail == 0 {
            return Err(Error::range("tail", 0, "tail >= 1"));
        }
        let rows: Vec<Row> = self
            .rows
            .iter()
            .copied()
            .filter(|r| publishes(r, &self.requests, Some(tail)))
            .collect();
        let query_starts = self.query_starts.as_ref().map(|q0| {
            q0.iter()
                .zip(&self.requests)
                .map(|(&q, r)| q.max(r.seq_len.saturating_sub(tail)))
                .collect()
        });
        Ok(Batch {
            ratio: self.ratio,
            requests: self.requests.clone(),
            rows,
            query_starts,
        })
    }
}

/// Whether a source row publishes candidate blocks: every row without a tail, else
/// the rows at positions `p >= S_b - tail` (the last `tail` rows of a contiguous request).
pub fn publishes(row: &Row, requests: &[Request], tail: Option<usize>) -> bool {
    match tail {
        None => true,
        // `p >= S_b - tail`, written so that a huge tail cannot overflow.
        Some(t) => row.position >= requests[row.request].seq_len.saturating_sub(t),
    }
}
