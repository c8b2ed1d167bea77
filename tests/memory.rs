//! The measured heap high-water mark of the chunked driver never exceeds the plan's
//! peak. A counting global allocator sees every allocation of the process; this
//! binary runs without the test harness so that nothing else allocates meanwhile.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use common::strategies::{build, Shape};
use dsa_indexer::dump::RoleKind;
use dsa_indexer::indexer::run_cpu;
use dsa_indexer::problem::Format;
use dsa_indexer::reference;

struct Counting;
static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
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
        if !p.is_null() {
            let now = CURRENT.fetch_add(l.size(), SeqCst) + l.size();
            PEAK.fetch_max(now, SeqCst);
        }
        p
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = System.realloc(p, l, new);
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

fn case(q: Format, k: Format, threads: usize, budget: usize) {
    // A source layer with a tail, n > B * NB, several requests, many tiles.
    let s = Shape {
        heads: 16,
        dim: 64,
        q_format: q,
        k_format: k,
        topk: 37,
        block_size: 4,
        num_blocks: 8,
        role: RoleKind::Source,
        tail: Some(150),
        seed: 3,
        ..Shape::fp4(vec![900, 700, 40], vec![700, 0, 10])
    };
    let d = build(&s);
    let batch = d.batch().unwrap();
    let p = d.problem(&batch, None).unwrap();
    let want = reference::run(&p);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        // Warm the pool so that its own lazily built per-thread state (work-stealing
        // epochs, thread handles) exists before counting: it belongs to rayon, once
        // per thread, not to the driver.
        for _ in 0..3 {
            pool.broadcast(|_| rayon::join(|| (), || ()));
            run_cpu(&p, budget).unwrap();
        }
        let base = CURRENT.load(SeqCst);
        PEAK.store(base, SeqCst);
        let (out, plan) = run_cpu(&p, budget).unwrap();
        let peak = PEAK.load(SeqCst);
        let pb = out.published.as_ref().unwrap();
        let outputs = out.raw.len() * 4
            + out.page.len() * 4
            + pb.blocks.len() * 4
            + pb.rows.capacity() * 16
            + pb.seq_lens.capacity() * 8
            + plan.tiles.capacity() * std::mem::size_of_val(&plan.tiles[0]);
        let measured = peak - base - outputs;
        let pk = plan.peak;
        println!(
            "{q}x{k} threads {threads} budget {budget}: {} tiles, measured {measured} B, planned {} B \
             (logits {} + block scores {} + candidate ids {} + top-k {} + assembly {} + operands {})",
            plan.tiles.len(),
            pk.total(),
            pk.logits_tile,
            pk.block_scores,
            pk.candidate_ids,
            pk.topk_scratch,
            pk.index_assembly,
            pk.operands
        );
        assert!(plan.tiles.len() >= 3, "at least 3 tiles");
        assert!(batch.rows().iter().any(|r| r.n > s.block_size * s.num_blocks), "n > B*NB");
        for (name, v) in [
            ("logits", pk.logits_tile),
            ("block scores", pk.block_scores),
            ("candidate ids", pk.candidate_ids),
            ("top-k", pk.topk_scratch),
            ("assembly", pk.index_assembly),
        ] {
            assert!(v > 0, "term {name} is zero");
        }
        assert!(measured <= pk.total(), "measured {measured} > planned {}", pk.total());
        // Most of the plan is really used: the accounting is not padded.
        assert!(measured * 10 >= pk.total() * 9, "measured {measured} far below planned {}", pk.total());
        assert_eq!(out, want, "chunked output equals the reference");
    });
}

fn main() {
    for (q, k) in [
        (Format::E2m1, Format::E2m1),
        (Format::E4m3, Format::E4m3),
        (Format::E2m1, Format::E4m3),
    ] {
        for threads in [1, 2, 3] {
            for budget in [64 << 10, 200 << 10] {
                case(q, k, threads, budget);
            }
        }
    }
    println!("memory: ok");
}
