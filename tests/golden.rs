//! The golden vectors (`tests/golden/`), computed from docs/SPEC.md by an independent
//! implementation, reproduced bitwise by the reference.

mod common;

use common::{bits, check, check_expected_outputs, golden_files};
use dsa_indexer::dump::Dump;
use dsa_indexer::reference;

#[test]
fn reference_reproduces_every_golden_file() {
    let files = golden_files();
    assert!(
        files.len() >= 14,
        "expected the golden files, found {}",
        files.len()
    );
    for path in files {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let dump = Dump::from_bytes(&std::fs::read(&path).unwrap())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let batch = dump.batch().unwrap_or_else(|e| panic!("{name}: {e}"));
        let published = dump.published_input(&batch);
        let p = dump
            .problem(&batch, published.as_ref())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let e = &dump.expected;
        let ks: Vec<i32> = batch.rows().iter().map(|r| r.ks as i32).collect();
        let ke: Vec<i32> = batch.rows().iter().map(|r| r.ke() as i32).collect();
        check(&name, "ks", &ks, e.ks.as_ref().expect("expected_ks"));
        check(&name, "ke", &ke, e.ke.as_ref().expect("expected_ke"));
        check(
            &name,
            "logits (bits)",
            &bits(&reference::logits(&p)),
            &bits(e.logits.as_ref().expect("expected_logits")),
        );
        check_expected_outputs(&name, &p, &reference::run(&p), e);
    }
}

#[test]
fn quantizers_reproduce_the_golden_file() {
    use dsa_indexer::formats::{quantize_fp4_blocks, quantize_fp8_rows, Fp4Floor, Fp8Scale};
    use safetensors::SafeTensors;
    let path = common::golden_dir().join("quantizers.safetensors");
    let buf = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&buf).unwrap();
    let f32s = |n: &str| -> Vec<f32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let u8s = |n: &str| -> Vec<u8> { st.tensor(n).unwrap().data().to_vec() };
    let x = f32s("x");
    let rows = x.len() / 128;
    assert!(rows > 0);
    let (mut packed, mut scale, mut fp8, mut fp8s) = (vec![], vec![], vec![], vec![]);
    for r in x.chunks(128) {
        let (p, s) = quantize_fp4_blocks(r, Fp4Floor::AmaxFloor).unwrap();
        packed.extend(p);
        scale.extend(s);
        let (c, s) = quantize_fp8_rows(r, Fp8Scale::Exact).unwrap();
        fp8.extend(c);
        fp8s.push(s);
    }
    let f = "quantizers.safetensors";
    check(
        f,
        "expected_fp4_packed",
        &packed,
        &u8s("expected_fp4_packed"),
    );
    check(f, "expected_fp4_scale", &scale, &u8s("expected_fp4_scale"));
    check(f, "expected_fp8", &fp8, &u8s("expected_fp8"));
    check(
        f,
        "expected_fp8_scale (bits)",
        &bits(&fp8s),
        &bits(&f32s("expected_fp8_scale")),
    );
}

#[test]
fn chunked_driver_reproduces_every_golden_file_at_several_budgets() {
    use dsa_indexer::indexer::run_cpu;
    for path in golden_files() {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let dump = Dump::from_bytes(&std::fs::read(&path).unwrap()).unwrap();
        let batch = dump.batch().unwrap();
        let published = dump.published_input(&batch);
        let p = dump.problem(&batch, published.as_ref()).unwrap();
        let e = &dump.expected;
        for budget in [1usize, 64, 1000, 1 << 20, usize::MAX] {
            let (out, plan) = run_cpu(&p, budget).unwrap();
            let tag = format!("{name} at budget {budget} ({} tiles)", plan.tiles.len());
            check_expected_outputs(&tag, &p, &out, e);
        }
    }
}
