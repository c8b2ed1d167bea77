//! The measured heap high-water mark of the chunked driver is the plan's peak to the
//! byte, and the CPU backend's two context-dependent buffers (the logits tile and the
//! block scores) are allocated at the sizes computed here from the batch and the tile
//! rows alone: every role, every format pair. A counting global allocator sees every
//! allocation of the process; this binary runs without the test harness so that
//! nothing else allocates meanwhile.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};

use common::strategies::{batch_and_candidates, build, Shape};
use dsa_indexer::batch::Batch;
use dsa_indexer::dump::RoleKind;
use dsa_indexer::indexer::{run, run_cpu, Backend, CpuBackend, RowFootprint};
use dsa_indexer::plan::Plan;
use dsa_indexer::problem::{Format, Problem, Role};
use dsa_indexer::reference::{self, Output};

struct Counting;
static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// While set, the size of every allocation goes to `LOG` (no allocation in the allocator).
static LOGGING: AtomicBool = AtomicBool::new(false);
static LOG: [AtomicUsize; 1024] = [const { AtomicUsize::new(0) }; 1024];
static LOGGED: AtomicUsize = AtomicUsize::new(0);

fn log(size: usize) {
    if LOGGING.load(SeqCst) {
        let i = LOGGED.fetch_add(1, SeqCst);
        if let Some(slot) = LOG.get(i) {
            slot.store(size, SeqCst);
        }
    }
}

// SAFETY: forwards to the system allocator unchanged; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        log(l.size());
        if !p.is_null() {
            let now = CURRENT.fetch_add(l.size(), SeqCst) + l.size();
            PEAK.fetch_max(now, SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        CURRENT.fetch_sub(l.size(), SeqCst);
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(l);
        log(l.size());
        if !p.is_null() {
            let now = CURRENT.fetch_add(l.size(), SeqCst) + l.size();
            PEAK.fetch_max(now, SeqCst);
        }
        p
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = System.realloc(p, l, new);
        log(new);
        if !q.is_null() {
            // Count the moment both blocks may exist.
            let now = CURRENT.fetch_add(new, SeqCst) + new;
            PEAK.fetch_max(now, SeqCst);
            CURRENT.fetch_sub(l.size(), SeqCst);
        }
        q
    }
}

#[global_allocator]
static A: Counting = Counting;

/// The CPU backend, logging the sizes of what its `begin` allocates.
struct Probe {
    inner: CpuBackend,
    begin_allocs: Vec<usize>,
}

impl Backend for Probe {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn max_topk(&self) -> usize {
        self.inner.max_topk()
    }
    fn footprint(&self, p: &Problem) -> RowFootprint {
        self.inner.footprint(p)
    }
    fn begin(&mut self, p: &Problem, plan: &Plan) -> dsa_indexer::Result<()> {
        LOGGED.store(0, SeqCst);
        LOGGING.store(true, SeqCst);
        let r = self.inner.begin(p, plan);
        LOGGING.store(false, SeqCst);
        let n = LOGGED.load(SeqCst);
        assert!(
            n <= LOG.len(),
            "{n} allocations in begin, the log holds {}",
            LOG.len()
        );
        self.begin_allocs = LOG[..n].iter().map(|a| a.load(SeqCst)).collect();
        r
    }
    fn tile(
        &mut self,
        p: &Problem,
        plan: &Plan,
        t: usize,
        out: &mut Output,
    ) -> dsa_indexer::Result<()> {
        self.inner.tile(p, plan, t, out)
    }
    fn end(&mut self, p: &Problem, out: &mut Output) -> dsa_indexer::Result<()> {
        self.inner.end(p, out)
    }
}

/// The logits-tile and block-score bytes of a run over `plan`'s tiles, from the batch
/// and the tile rows alone: a row with `n` visible keys holds `n` f32 logits rounded
/// up to 4 (16 bytes), a publishing row (a source's, at `p >= S_b - tail`) holds one
/// u32 score per block of `B` keys; each buffer is its largest tile's sum. Also checks
/// that the tiles cover the rows once, in order, and that each tile's own figures are
/// these sums.
fn buffers(
    batch: &Batch,
    role: RoleKind,
    tail: Option<usize>,
    b: usize,
    plan: &Plan,
) -> (usize, usize) {
    let rows = batch.rows();
    let seq = batch.seq_lens();
    let publishes = |i: usize| {
        role == RoleKind::Source
            && tail.is_none_or(|t| rows[i].position + t >= seq[rows[i].request])
    };
    let mut next = 0;
    let (mut logits, mut blocks) = (0, 0);
    for (t, tile) in plan.tiles.iter().enumerate() {
        assert_eq!(
            tile.rows.start, next,
            "tile {t} starts where the last ended"
        );
        next = tile.rows.end;
        let l: usize = tile.rows.clone().map(|i| rows[i].n.div_ceil(4) * 16).sum();
        let bs: usize = tile
            .rows
            .clone()
            .filter(|&i| publishes(i))
            .map(|i| rows[i].n.div_ceil(b) * 4)
            .sum();
        assert_eq!(tile.logits_bytes, l, "tile {t}'s logits bytes");
        assert_eq!(tile.block_score_bytes, bs, "tile {t}'s block-score bytes");
        logits = logits.max(l);
        blocks = blocks.max(bs);
    }
    assert_eq!(next, rows.len(), "the tiles cover every row");
    (logits, blocks)
}

/// Bytes of `out`'s heap blocks (they are inputs to the peak, not transient).
fn output_bytes(out: &Output, plan: &Plan) -> usize {
    let published = out.published.as_ref().map_or(0, |pb| {
        pb.blocks.len() * 4 + pb.rows.capacity() * 16 + pb.seq_lens.capacity() * 8
    });
    out.raw.len() * 4
        + out.page.len() * 4
        + published
        + plan.tiles.capacity() * std::mem::size_of_val(&plan.tiles[0])
}

fn case(q: Format, k: Format, role: RoleKind) {
    // Several requests, n > B * NB, many tiles; a source publishes its rows' tail.
    let s = Shape {
        heads: 16,
        dim: 64,
        q_format: q,
        k_format: k,
        topk: 37,
        block_size: 4,
        num_blocks: 8,
        role,
        tail: Some(150),
        seed: 3,
        ..Shape::fp4(vec![900, 700, 40], vec![700, 0, 10])
    };
    let d = build(&s);
    let (batch, published) = batch_and_candidates(&d);
    let p = d.problem(&batch, published.as_ref()).unwrap();
    let tail = d.meta.tail;
    let want = reference::run(&p);
    assert!(
        batch
            .rows()
            .iter()
            .any(|r| r.n > s.block_size * s.num_blocks),
        "n > B*NB"
    );
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for budget in [64 << 10, 200 << 10] {
            pool.install(|| measure(&p, &s, tail, &want, threads, budget));
        }
    }
}

fn measure(
    p: &Problem,
    s: &Shape,
    tail: Option<usize>,
    want: &Output,
    threads: usize,
    budget: usize,
) {
    let (q, k, role) = (s.q_format, s.k_format, s.role);
    // Warm the pool so that its own lazily built per-thread state (work-stealing
    // epochs, thread handles) exists before counting: it belongs to rayon, once per
    // thread, not to the driver.
    for _ in 0..3 {
        rayon::broadcast(|_| rayon::join(|| (), || ()));
        run_cpu(p, budget).unwrap();
    }
    let base = CURRENT.load(SeqCst);
    PEAK.store(base, SeqCst);
    let (out, plan) = run_cpu(p, budget).unwrap();
    let peak = PEAK.load(SeqCst);
    let measured = peak - base - output_bytes(&out, &plan);
    let pk = plan.peak;
    let tag = format!("{q}x{k} {role:?} threads {threads} budget {budget}");
    println!(
        "{tag}: {} tiles, measured {measured} B, planned {} B (logits {} + block scores {} \
         + candidate ids {} + top-k {} + assembly {} + operands {})",
        plan.tiles.len(),
        pk.total(),
        pk.logits_tile,
        pk.block_scores,
        pk.candidate_ids,
        pk.topk_scratch,
        pk.index_assembly,
        pk.operands
    );
    assert!(plan.tiles.len() >= 3, "{tag}: at least 3 tiles");
    let source = matches!(p.role, Role::Source { .. });
    for (name, v, expected) in [
        ("logits", pk.logits_tile, true),
        ("block scores", pk.block_scores, source),
        ("candidate ids", pk.candidate_ids, source),
        ("top-k", pk.topk_scratch, true),
        ("assembly", pk.index_assembly, true),
    ] {
        assert_eq!(v > 0, expected, "{tag}: term {name} is {v}");
    }
    // The plan is the heap high-water mark to the byte: not exceeded, not padded.
    assert_eq!(measured, pk.total(), "{tag}: measured vs planned peak");
    assert_eq!(&out, want, "{tag}: chunked output equals the reference");

    // The two context-dependent buffers, computed from the batch and the tile rows.
    let (logits, blocks) = buffers(p.batch, role, tail, s.block_size, &plan);
    assert_eq!(pk.logits_tile, logits, "{tag}: the plan's logits tile");
    assert_eq!(pk.block_scores, blocks, "{tag}: the plan's block scores");
    // Both live at once during the measured run.
    assert!(
        measured >= logits + blocks,
        "{tag}: measured {measured} < logits {logits} + block scores {blocks}"
    );
    // And `begin` allocates exactly these sizes (and nothing larger).
    let mut probe = Probe {
        inner: CpuBackend::new(),
        begin_allocs: Vec::new(),
    };
    let (out, _) = run(&mut probe, p, budget).unwrap();
    assert_eq!(&out, want, "{tag}: through the probe");
    let allocs = &probe.begin_allocs;
    assert!(
        allocs.contains(&logits),
        "{tag}: no {logits}-byte logits buffer in begin's allocations {allocs:?}"
    );
    if blocks > 0 {
        assert!(
            allocs.contains(&blocks),
            "{tag}: no {blocks}-byte block-score buffer in begin's allocations {allocs:?}"
        );
    }
    assert_eq!(
        allocs.iter().max(),
        Some(&logits),
        "{tag}: begin's largest allocation {allocs:?}"
    );
}

fn main() {
    for (q, k) in [
        (Format::E2m1, Format::E2m1),
        (Format::E4m3, Format::E4m3),
        (Format::E2m1, Format::E4m3),
        (Format::E4m3, Format::E2m1),
    ] {
        for role in [RoleKind::Plain, RoleKind::Source, RoleKind::Consumer] {
            case(q, k, role);
        }
    }
    println!("memory: ok");
}
