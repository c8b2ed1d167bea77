//! Every dtype the dump schema accepts (`docs/cli.md`, "Dump schema"): the same problem
//! written in each reads to the same [`Dump`] and replays to the same outputs and verdict
//! as the plain `U8` / `F32` file; a wrong byte order, a wrong `F4` shape or a wrong byte
//! count does not. The dumps of `tests/fixtures/`, written by PyTorch with torch's own
//! dtypes (`write_torch_dump.py`), replay like the same problems re-encoded here in
//! plain dtypes.

mod common;

use std::collections::HashMap;

use dsa_indexer::dump::Dump;
use dsa_indexer::reference;
use dsa_indexer::verdict::{judge, Options, Verdict};
use dsa_indexer::Error;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

/// One tensor: name, dtype, shape, little-endian bytes.
type Tensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// A file's metadata and tensors.
#[derive(Clone)]
struct File {
    meta: HashMap<String, String>,
    tensors: Vec<Tensor>,
}

impl File {
    fn parse(buf: &[u8]) -> File {
        let (_, header) = SafeTensors::read_metadata(buf).unwrap();
        let st = SafeTensors::deserialize(buf).unwrap();
        let mut tensors: Vec<Tensor> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
            .collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        File {
            meta: header.metadata().clone().unwrap_or_default(),
            tensors,
        }
    }

    fn golden(name: &str) -> File {
        File::parse(&std::fs::read(common::golden_dir().join(name)).unwrap())
    }

    fn get(&self, name: &str) -> &Tensor {
        self.tensors
            .iter()
            .find(|t| t.0 == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    fn get_mut(&mut self, name: &str) -> &mut Tensor {
        self.tensors
            .iter_mut()
            .find(|t| t.0 == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    fn put(&mut self, t: Tensor) {
        self.tensors.retain(|x| x.0 != t.0);
        self.tensors.push(t);
    }

    /// Serialized by the `safetensors` crate, which checks each tensor's byte count.
    fn bytes(&self) -> Vec<u8> {
        let views: Vec<(String, TensorView)> = self
            .tensors
            .iter()
            .map(|(n, dt, s, b)| {
                let v = TensorView::new(*dt, s.clone(), b)
                    .unwrap_or_else(|e| panic!("{n}: {dt:?} {s:?} {} bytes: {e}", b.len()));
                (n.clone(), v)
            })
            .collect();
        safetensors::serialize(views, Some(self.meta.clone())).unwrap()
    }

    /// Serialized by hand, with no check that a tensor's bytes fit its dtype and shape.
    fn bytes_unchecked(&self) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), serde_json::json!(self.meta));
        let mut data = Vec::new();
        for (n, dt, s, b) in &self.tensors {
            let a = data.len();
            data.extend_from_slice(b);
            header.insert(
                n.clone(),
                serde_json::json!({
                    "dtype": dt.to_string(),
                    "shape": s,
                    "data_offsets": [a, data.len()],
                }),
            );
        }
        let mut h = serde_json::to_vec(&header).unwrap();
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        out.extend_from_slice(&data);
        out
    }
}

/// What a replay of a file gives: the parsed dump, the reference's outputs and logits,
/// and the verdict on the dump's expected tensors.
#[derive(Debug, PartialEq)]
struct Replayed {
    dump: Dump,
    raw: Vec<i32>,
    page: Vec<i32>,
    published: Option<Vec<i32>>,
    logits: Vec<u32>,
    verdict: Verdict,
}

fn replay(buf: &[u8]) -> Result<Replayed, Error> {
    let dump = Dump::from_bytes(buf)?;
    let batch = dump.batch()?;
    let published = dump.published_input(&batch);
    let p = dump.problem(&batch, published.as_ref())?;
    let out = reference::run(&p);
    let verdict = judge(
        &p,
        &out,
        &dump.expected,
        dump.engine_logits.as_ref(),
        &Options::default(),
    )?;
    let logits = common::bits(&reference::logits(&p));
    let raw = out.raw.iter().copied().collect();
    let page = out.page.iter().copied().collect();
    let published = out
        .published
        .as_ref()
        .map(|pb| pb.blocks.iter().copied().collect());
    Ok(Replayed {
        dump,
        raw,
        page,
        published,
        logits,
        verdict,
    })
}

/// `variant` replays exactly as `base`: the same dump, outputs and verdict.
fn assert_same(case: &str, base: &Replayed, variant: &File) {
    assert_replays_as(case, base, &variant.bytes());
}

fn assert_replays_as(case: &str, base: &Replayed, buf: &[u8]) {
    let got = replay(buf).unwrap_or_else(|e| panic!("{case}: {e}"));
    assert_eq!(got.dump, base.dump, "{case}: the parsed dump");
    assert_eq!(got.raw, base.raw, "{case}: raw");
    assert_eq!(got.page, base.page, "{case}: page");
    assert_eq!(got.published, base.published, "{case}: published");
    assert_eq!(got.logits, base.logits, "{case}: logits (bits)");
    assert_eq!(got.verdict, base.verdict, "{case}: verdict");
}

fn retype(f: &mut File, name: &str, dt: Dtype) {
    f.get_mut(name).1 = dt;
}

/// Packed fp4 `U8 [.., D/2]` as `F4 [.., D]`: the same bytes, the shape in elements.
fn to_f4(f: &mut File, name: &str) {
    let t = f.get_mut(name);
    assert_eq!(t.1, Dtype::U8, "{name}");
    t.1 = Dtype::F4;
    *t.2.last_mut().unwrap() *= 2;
}

/// UE8M0 `U8 [.., G]` as `I32 [..]` words, `byte_order` writing each little-endian
/// word; the `4 - G` padding bytes are 0xFF.
fn to_words(f: &mut File, name: &str, byte_order: fn(u32) -> [u8; 4]) {
    let t = f.get_mut(name);
    assert_eq!(t.1, Dtype::U8, "{name}");
    let g = *t.2.last().unwrap();
    assert!((1..=4).contains(&g), "{name}: {g} groups");
    let bytes =
        t.3.chunks_exact(g)
            .flat_map(|c| {
                let mut w = [0xFFu8; 4];
                w[..g].copy_from_slice(c);
                byte_order(u32::from_le_bytes(w))
            })
            .collect();
    t.1 = Dtype::I32;
    t.2.pop();
    t.3 = bytes;
}

/// A re-encoding of some of a file's tensors.
type Edit = fn(&mut File);

const FP4_FILES: [&str; 3] = [
    // D = 128: four groups, a scale word with no padding.
    "v41_plain.safetensors",
    // D = 64: two groups, two padding bytes.
    "v41_ratio2.safetensors",
    // D = 32, a source layer: one group, three padding bytes; published blocks.
    "source_tail.safetensors",
];

#[test]
fn fp4_dumps_replay_the_same_in_i8_f4_e8m0_and_i32_words() {
    for file in FP4_FILES {
        let plain = File::golden(file);
        let base = replay(&plain.bytes()).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(
            base.verdict.status.as_str(),
            "identical",
            "{file}: the golden file replays identical"
        );
        let variants: [(&str, Edit); 6] = [
            ("q, k I8", |f| {
                retype(f, "q", Dtype::I8);
                retype(f, "k", Dtype::I8);
            }),
            ("q, k F4", |f| {
                to_f4(f, "q");
                to_f4(f, "k");
            }),
            ("scales F8_E8M0", |f| {
                retype(f, "q_scale", Dtype::F8_E8M0);
                retype(f, "k_scale", Dtype::F8_E8M0);
            }),
            ("scales I32 words", |f| {
                to_words(f, "q_scale", u32::to_le_bytes);
                to_words(f, "k_scale", u32::to_le_bytes);
            }),
            ("q F4, q_scale I32, k I8, k_scale F8_E8M0", |f| {
                to_f4(f, "q");
                to_words(f, "q_scale", u32::to_le_bytes);
                retype(f, "k", Dtype::I8);
                retype(f, "k_scale", Dtype::F8_E8M0);
            }),
            ("q I8, q_scale F8_E8M0, k F4, k_scale I32", |f| {
                retype(f, "q", Dtype::I8);
                retype(f, "q_scale", Dtype::F8_E8M0);
                to_f4(f, "k");
                to_words(f, "k_scale", u32::to_le_bytes);
            }),
        ];
        for (name, edit) in variants {
            let mut f = plain.clone();
            edit(&mut f);
            assert_same(&format!("{file}, {name}"), &base, &f);
        }
    }
}

const E4M3_FILES: [(&str, &[&str]); 4] = [
    ("v32_plain.safetensors", &["q", "k"]),
    ("v4_ratio4.safetensors", &["q", "k"]),
    ("mixed_q8_k4.safetensors", &["q"]),
    ("mixed_q4_k8.safetensors", &["k"]),
];

#[test]
fn e4m3_dumps_replay_the_same_in_f8_e4m3() {
    for (file, fp8) in E4M3_FILES {
        let plain = File::golden(file);
        let base = replay(&plain.bytes()).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(base.verdict.status.as_str(), "identical", "{file}");
        for name in fp8 {
            let mut f = plain.clone();
            retype(&mut f, name, Dtype::F8_E4M3);
            assert_same(&format!("{file}, {name} F8_E4M3"), &base, &f);
        }
        let mut f = plain.clone();
        for name in fp8 {
            retype(&mut f, name, Dtype::F8_E4M3);
        }
        assert_same(&format!("{file}, all fp8 F8_E4M3"), &base, &f);
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bf16_bytes(v: &[f32], byte_order: fn(half::bf16) -> [u8; 2]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| {
            let b = half::bf16::from_f32(x);
            assert_eq!(b.to_f32().to_bits(), x.to_bits(), "{x} is not a bf16 value");
            byte_order(b)
        })
        .collect()
}

fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect()
}

/// `file` with its weights rounded to bf16 (written F32), and `engine_logits F32 [T, L]`:
/// the reference's logits rounded to bf16 inside each row's `[ks, ke)`, and bf16 filler
/// values outside it (which the verdict does not read).
fn bf16_valued(file: &str) -> File {
    let mut f = File::golden(file);
    let w = round_bf16(&f32s(&f.get("weights").3));
    f.get_mut("weights").3 = f32_bytes(&w);

    let d = Dump::from_bytes(&f.bytes()).unwrap();
    let batch = d.batch().unwrap();
    let published = d.published_input(&batch);
    let p = d.problem(&batch, published.as_ref()).unwrap();
    let flat = reference::logits(&p);
    let l = f.get("k").2[0];
    let t = batch.num_rows();
    let mut m = vec![0f32; t * l];
    let mut at = 0;
    for (i, r) in batch.rows().iter().enumerate() {
        for j in 0..l {
            m[i * l + j] = if (r.ks..r.ke()).contains(&j) {
                at += 1;
                half::bf16::from_f32(flat[at - 1]).to_f32()
            } else {
                // Filler, exactly representable: -2^20 - 2^13 and 3 * 2^-7.
                [-1_056_768.0, 0.0234375][(i + j) % 2]
            };
        }
    }
    assert_eq!(at, flat.len(), "{file}: visible logits");
    f.put((
        "engine_logits".into(),
        Dtype::F32,
        vec![t, l],
        f32_bytes(&m),
    ));
    f
}

fn to_bf16(f: &mut File, name: &str, byte_order: fn(half::bf16) -> [u8; 2]) {
    let t = f.get_mut(name);
    assert_eq!(t.1, Dtype::F32, "{name}");
    t.1 = Dtype::BF16;
    t.3 = bf16_bytes(&f32s(&t.3), byte_order);
}

#[test]
fn bf16_weights_and_engine_logits_replay_as_their_f32_values() {
    for file in ["v41_ratio2.safetensors", "v4_ratio4.safetensors"] {
        let plain = bf16_valued(file);
        let base = replay(&plain.bytes()).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(base.verdict.tensor("engine_logits").is_some(), "{file}");
        for names in [
            &["weights"][..],
            &["engine_logits"],
            &["weights", "engine_logits"],
        ] {
            let mut f = plain.clone();
            for n in names {
                to_bf16(&mut f, n, half::bf16::to_le_bytes);
            }
            assert_same(&format!("{file}, {names:?} BF16"), &base, &f);
        }
        // The same values big-endian are other values: the test sees the byte order.
        let mut f = plain.clone();
        to_bf16(&mut f, "weights", half::bf16::to_be_bytes);
        let got = replay(&f.bytes());
        assert!(
            got.as_ref()
                .map_or(true, |g| g.dump.weights != base.dump.weights),
            "{file}: big-endian BF16 weights read as the little-endian ones"
        );
    }
}

fn dump_error(buf: &[u8]) -> (String, String) {
    match Dump::from_bytes(buf) {
        Err(Error::Dump { tensor, problem }) => (tensor, problem),
        Err(e) => panic!("expected a dump error, got {e}"),
        Ok(_) => panic!("expected a dump error, the file parsed"),
    }
}

#[test]
fn f4_shape_in_bytes_is_an_error_naming_the_tensor() {
    for file in FP4_FILES {
        for name in ["q", "k"] {
            // The shape counts bytes, the bytes are all there: `safetensors` finds
            // [.., D/2] F4 elements in D/2 bytes inconsistent.
            let mut f = File::golden(file);
            retype(&mut f, name, Dtype::F4);
            let (tensor, problem) = dump_error(&f.bytes_unchecked());
            assert_eq!(tensor, name, "{file}: {problem}");
            assert!(problem.contains("F4"), "{file}, {name}: {problem}");

            // The shape counts bytes and the bytes fit it (half the codes): the
            // schema's shape check.
            let mut f = File::golden(file);
            retype(&mut f, name, Dtype::F4);
            let t = f.get_mut(name);
            let n = t.3.len() / 2;
            t.3.truncate(n);
            let (tensor, problem) = dump_error(&f.bytes());
            assert_eq!(tensor, name, "{file}: {problem}");
        }
    }
}

#[test]
fn big_endian_scale_words_do_not_replay_as_the_little_endian_ones() {
    for file in FP4_FILES {
        let plain = File::golden(file);
        let base = replay(&plain.bytes()).unwrap();
        for name in ["q_scale", "k_scale"] {
            let mut f = plain.clone();
            to_words(&mut f, name, u32::to_be_bytes);
            match replay(&f.bytes()) {
                // A byte of 255 (the padding read as a scale) is reserved in UE8M0.
                Err(e) => assert!(e.to_string().contains(name), "{file}, {name}: {e}"),
                Ok(got) => {
                    assert_ne!(got.dump, base.dump, "{file}, {name}: the parsed dump");
                    assert_ne!(
                        (&got.logits, &got.verdict),
                        (&base.logits, &base.verdict),
                        "{file}, {name} big-endian: the same logits and verdict"
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_tensor_with_the_wrong_byte_count_is_an_error_naming_it() {
    let plain = bf16_valued("v4_ratio4.safetensors");
    for name in ["weights", "engine_logits"] {
        for extra in [-2isize, 2, 4] {
            let mut f = plain.clone();
            to_bf16(&mut f, name, half::bf16::to_le_bytes);
            let t = f.get_mut(name);
            let n = (t.3.len() as isize + extra) as usize;
            t.3.resize(n, 0);
            let (tensor, problem) = dump_error(&f.bytes_unchecked());
            assert_eq!(tensor, name, "{name}, {extra:+} bytes: {problem}");
            assert!(problem.contains("BF16"), "{name}: {problem}");
        }
        // F32 bytes labelled BF16 (twice the bytes).
        let mut f = plain.clone();
        retype(&mut f, name, Dtype::BF16);
        let (tensor, _) = dump_error(&f.bytes_unchecked());
        assert_eq!(tensor, name);
    }
}

fn fixture(name: &str) -> Vec<u8> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("tests/fixtures/{name}: {e}"))
}

/// The same file in the golden schema's plain dtypes: byte tensors `U8` (`F4 [.., D]` as
/// `U8 [.., D/2]`), scale words `U8 [.., G]`, `BF16` as `F32`.
fn to_plain(f: &File) -> File {
    let g = f.meta["dim"].parse::<usize>().unwrap() / 32;
    let mut out = f.clone();
    for (name, dt, shape, b) in &mut out.tensors {
        match *dt {
            Dtype::U8 | Dtype::F32 => {}
            Dtype::I8 | Dtype::F8_E4M3 | Dtype::F8_E8M0 => *dt = Dtype::U8,
            Dtype::F4 => {
                *dt = Dtype::U8;
                *shape.last_mut().unwrap() /= 2;
            }
            Dtype::BF16 => {
                *dt = Dtype::F32;
                *b = b
                    .chunks_exact(2)
                    .flat_map(|c| {
                        half::bf16::from_le_bytes([c[0], c[1]])
                            .to_f32()
                            .to_le_bytes()
                    })
                    .collect();
            }
            Dtype::I32 if name.ends_with("_scale") => {
                *dt = Dtype::U8;
                shape.push(g);
                *b = b.chunks_exact(4).flat_map(|w| w[..g].to_vec()).collect();
            }
            Dtype::I32 => {}
            other => panic!("{name}: {other:?}"),
        }
    }
    out
}

/// A tensor's name, dtype and shape in a file.
type Held = (&'static str, Dtype, &'static [usize]);

/// The dtypes each PyTorch file was written in (`write_torch_dump.py`).
const TORCH_FILES: [(&str, &[Held]); 2] = [
    (
        "torch_q8_k4.safetensors",
        &[
            ("q", Dtype::F8_E4M3, &[6, 8, 64]),
            ("k", Dtype::F4, &[12, 64]),
            ("k_scale", Dtype::F8_E8M0, &[12, 2]),
            ("weights", Dtype::BF16, &[6, 8]),
            ("engine_logits", Dtype::BF16, &[6, 12]),
        ],
    ),
    (
        "torch_q4_k8.safetensors",
        &[
            ("q", Dtype::F4, &[6, 8, 64]),
            ("q_scale", Dtype::I32, &[6, 8]),
            ("k", Dtype::F8_E4M3, &[12, 64]),
            ("k_scale", Dtype::F32, &[12]),
            ("weights", Dtype::BF16, &[6, 8]),
            ("engine_logits", Dtype::BF16, &[6, 12]),
        ],
    ),
];

#[test]
fn pytorch_dumps_replay_as_the_same_problem_in_plain_dtypes() {
    for (file, dtypes) in TORCH_FILES {
        let buf = fixture(file);
        let torch = File::parse(&buf);
        for &(name, dt, shape) in dtypes {
            let t = torch.get(name);
            assert_eq!((t.1, t.2.as_slice()), (dt, shape), "{file}: {name}");
        }
        let plain = to_plain(&torch);
        for t in &plain.tensors {
            assert!(
                [Dtype::U8, Dtype::I32, Dtype::F32].contains(&t.1),
                "{file}: {t:?}"
            );
        }
        let base = replay(&plain.bytes()).unwrap_or_else(|e| panic!("{file} in plain dtypes: {e}"));
        assert_replays_as(file, &base, &buf);

        // The top-k computed by the script in float64 from torch's decoding is the
        // reference's; its bf16 logits are within SPEC 4's bound.
        let v = &base.verdict;
        let status = |name: &str| {
            let t = v
                .tensor(name)
                .unwrap_or_else(|| panic!("{file}: no {name}"));
            (t.status.as_str(), t.notes.clone())
        };
        assert_eq!(
            status("raw").0,
            "identical",
            "{file}: {:?}",
            status("raw").1
        );
        assert_eq!(
            status("page").0,
            "identical",
            "{file}: {:?}",
            status("page").1
        );
        let (logits, notes) = status("engine_logits");
        assert_ne!(logits, "different", "{file}: engine_logits: {notes:?}");
        assert_ne!(v.status.as_str(), "different", "{file}");
    }
}
