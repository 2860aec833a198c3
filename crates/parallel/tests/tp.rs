//! Tensor parallelism equals the single-device run, on thread ranks: forward logits, loss and
//! every gradient (gathered), 20 AdamW steps, and greedy generation, for Llama and Ladder
//! (all layers and mixed), GQA with fewer key/value heads than ranks, tied embeddings; packed
//! rows (each rank attends inside the same segments with its heads); the fused, chunked head +
//! loss over vocabulary shards against one device's, and the unfused one.
use ferrolm_nn::module::ParamKind;
use ferrolm_nn::optim::{AdamW, AdamWConfig};
use ferrolm_nn::{generate, shift_labels, Llama, LlamaConfig, Packing};
use ferrolm_ops::{LossChunks, LossScale, Tokens};
use ferrolm_parallel::tp::{parallelize, TpShardings};
use ferrolm_parallel::{CommOptions, Communicator, ThreadComm};
use ferrolm_tensor::{no_grad, DType, Device, Rng, Tensor};
use ferrolm_testing::max_rel;
use ferrolm_testing::tiny::{tiny_llama_layers, tp_cases as cases};
use std::sync::Arc;

/// Loss and parameter updates within 1e-4 relative; logits and gradients within this of
/// their scale (f32 sums in another order).
const TOL: f64 = 2e-5;

/// A fresh model whose biases (and (1 + w) norms' weights) are not zero (transformers' init),
/// so that they count.
fn model(c: &LlamaConfig) -> ferrolm_tensor::Result<Llama> {
    let mut m = Llama::new(c.clone(), DType::F32, Device::Cpu, &mut Rng::new(1))?;
    let mut rng = Rng::new(2);
    let offset_norms = c.norm_offset() != 0.0;
    m.visit_params_mut(&mut |p, t| {
        if p.kind == ParamKind::Bias || (offset_norms && p.kind == ParamKind::Norm) {
            let b = Tensor::randn(p.shape.to_vec(), 0.2, DType::F32, Device::Cpu, &mut rng)?;
            b.set_requires_grad(true)?;
            *t = b;
        }
        Ok(())
    })?;
    Ok(m)
}

fn batch(c: &LlamaConfig, seed: u64) -> (Tensor, Tensor) {
    let (b, t) = (2, 9);
    let mut r = Rng::new(seed);
    let ids: Vec<i32> = (0..b * t).map(|_| r.below(c.vocab_size as u64) as i32).collect();
    let tg = shift_labels(&ids, t);
    (Tensor::from_vec(ids, vec![b, t], Device::Cpu).unwrap(), Tensor::from_vec(tg, vec![b, t], Device::Cpu).unwrap())
}

struct Outcome {
    logits: Vec<f32>,
    loss: f64,
    grads: Vec<(String, Vec<f32>)>,
}

/// Logits and loss, of packed rows where a packing is given.
fn logits_loss(m: &Llama, x: &Tensor, y: &Tensor, p: Option<&Packing>) -> ferrolm_tensor::Result<(Tensor, Tensor)> {
    match p {
        None => Ok((m.forward(x)?, m.loss(x, y)?)),
        Some(p) => Ok((m.forward_packed(x, p)?, m.loss_packed(x, y, p)?)),
    }
}

fn single(c: &LlamaConfig, x: &Tensor, y: &Tensor, p: Option<&Packing>) -> Outcome {
    let m = model(c).unwrap();
    let (logits, loss) = logits_loss(&m, x, y, p).unwrap();
    let logits = logits.to_vec::<f32>().unwrap();
    loss.backward().unwrap();
    let grads = m.parameters().into_iter().map(|(n, p)| (n, p.grad().unwrap().to_vec::<f32>().unwrap())).collect();
    Outcome { logits, loss: loss.item().unwrap(), grads }
}

fn sharded(c: &LlamaConfig, x: &Tensor, y: &Tensor, p: Option<&Packing>, comm: Arc<dyn Communicator>) -> ferrolm_tensor::Result<Outcome> {
    let mut m = model(c)?;
    let layout = parallelize(&mut m, &comm)?;
    let (logits, loss) = logits_loss(&m, x, y, p)?;
    let logits = logits.to_vec::<f32>()?;
    loss.backward()?;
    let mut grads = Vec::new();
    for (n, p) in m.parameters() {
        let g = p.grad().ok_or_else(|| ferrolm_tensor::Error::new("test", format!("no gradient for {n}")))?;
        grads.push((n.clone(), layout.gather(&n, &g, &comm)?.to_vec::<f32>()?));
    }
    Ok(Outcome { logits, loss: loss.item()?, grads })
}

#[test]
fn tp_forward_and_gradients_equal_single_device() {
    // Packed rows of the batch's shape (2, 9): segments of 4 + 5 and 1 + 6 + 2 tokens.
    let packing =
        Packing::new(9, &[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 0, 1], vec![vec![0, 4, 9], vec![0, 1, 7, 9]], Device::Cpu)
            .unwrap();
    for ((name, c), p) in cases().into_iter().flat_map(|c| [(c.clone(), None), (c, Some(&packing))]) {
        let name = if p.is_some() { format!("{name} packed") } else { name.to_string() };
        let (x, y) = batch(&c, 3);
        let want = single(&c, &x, &y, p);
        for tp in [2, 4] {
            let outs = ThreadComm::run(tp, CommOptions::default(), |comm| sharded(&c, &x, &y, p, comm)).unwrap();
            for (rank, got) in outs.iter().enumerate() {
                let el = max_rel(&got.logits, &want.logits);
                assert!(el < TOL, "{name} tp {tp} rank {rank}: logits rel err {el}");
                assert!((got.loss - want.loss).abs() < TOL * want.loss, "{name} tp {tp}: loss {} vs {}", got.loss, want.loss);
                for ((n, g), (_, w)) in got.grads.iter().zip(&want.grads) {
                    let e = max_rel(g, w);
                    assert!(e < TOL, "{name} tp {tp} rank {rank}: gradient of {n} rel err {e}");
                }
            }
        }
    }
}

/// The fused head + loss under `--tp 2` against one device: chunks of 4 tokens (not dividing
/// the 18), most targets ignored and one chunk with every target ignored, the step's scale
/// (`LossScale::Sum`), a tied and an untied head; each against one device with the same chunks
/// and with the unfused head (`--loss-chunk-tokens 0`), under tp 2 as well.
#[test]
fn the_chunked_head_over_vocabulary_shards_equals_single_device() {
    for (name, c) in cases().into_iter().take(2) {
        let (x, y) = batch(&c, 5);
        // Rows 4..8 ignored (the second chunk of 4 entirely), and every third row.
        let t: Vec<i32> =
            y.to_vec::<i32>().unwrap().iter().enumerate().map(|(i, &v)| if (4..8).contains(&i) || i % 3 == 0 { -100 } else { v }).collect();
        let trained = t.iter().filter(|&&v| v != -100).count() as f64;
        let tg = Tokens::upload(t, vec![2, 9], Device::Cpu).unwrap();
        let run = |m: &mut Llama, chunks: LossChunks| -> ferrolm_tensor::Result<(f64, Vec<(String, Tensor)>)> {
            m.loss_chunks = chunks;
            let loss = m.loss_with(&x, &tg, None, LossScale::Sum(0.5 / trained))?;
            loss.backward()?;
            let grads = m
                .parameters()
                .into_iter()
                .map(|(n, p)| Ok((n.clone(), p.grad().ok_or_else(|| ferrolm_tensor::Error::new("test", n))?)))
                .collect::<ferrolm_tensor::Result<_>>()?;
            Ok((loss.item()?, grads))
        };
        let one = |chunks| {
            let mut m = model(&c).unwrap();
            let (l, g) = run(&mut m, chunks).unwrap();
            (l, g.into_iter().map(|(n, g)| (n, g.to_vec::<f32>().unwrap())).collect::<Vec<_>>())
        };
        let want = one(LossChunks::Tokens(4));
        let unfused = one(LossChunks::Unfused);
        assert!((unfused.0 - want.0).abs() < TOL * want.0, "{name}: one device, unfused loss {} vs chunked {}", unfused.0, want.0);
        for chunks in [LossChunks::Tokens(4), LossChunks::Unfused] {
            let outs = ThreadComm::run(2, CommOptions::default(), |comm| {
                let mut m = model(&c)?;
                let layout = parallelize(&mut m, &comm)?;
                let (l, g) = run(&mut m, chunks)?;
                let g = g
                    .into_iter()
                    .map(|(n, g)| Ok((n.clone(), layout.gather(&n, &g, &comm)?.to_vec::<f32>()?)))
                    .collect::<ferrolm_tensor::Result<Vec<_>>>()?;
                Ok((l, g))
            })
            .unwrap();
            for (rank, got) in outs.iter().enumerate() {
                assert!((got.0 - want.0).abs() < TOL * want.0, "{name} {chunks:?} rank {rank}: loss {} vs {}", got.0, want.0);
                for (((n, g), (_, w)), (_, u)) in got.1.iter().zip(&want.1).zip(&unfused.1) {
                    let (e, eu) = (max_rel(g, w), max_rel(u, w));
                    assert!(
                        e < TOL && eu < TOL,
                        "{name} {chunks:?} rank {rank}: gradient of {n} rel err {e} (unfused on one device: {eu})"
                    );
                }
            }
        }
    }
}

/// 20 AdamW steps with global-norm clipping: the TP run's losses follow the single-device run's.
#[test]
fn tp_training_follows_single_device() {
    let steps = 20;
    let opt_cfg = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
    let clip = 0.5; // low enough to be active
    for (name, c) in cases().into_iter().skip(1) {
        // Two batches in turn: random tokens, so a falling loss means the model memorises them.
        let batches: Vec<(Tensor, Tensor)> = (0..steps).map(|s| batch(&c, 100 + s as u64 % 2)).collect();
        let want: Vec<f64> = {
            let m = model(&c).unwrap();
            let params = m.parameters();
            let mut opt = AdamW::new(&m.named_parameters(), opt_cfg.clone()).unwrap();
            batches
                .iter()
                .map(|(x, y)| {
                    let loss = m.loss(x, y).unwrap();
                    loss.backward().unwrap();
                    ferrolm_nn::optim::clip_grad_norm(&params, clip).unwrap();
                    opt.step(3e-3).unwrap();
                    opt.zero_grad();
                    loss.item().unwrap()
                })
                .collect()
        };
        for tp in [2, 4] {
            let got = ThreadComm::run(tp, CommOptions::default(), |comm| {
                let mut m = model(&c)?;
                let layout: TpShardings = parallelize(&mut m, &comm)?;
                let params = m.parameters();
                let mut opt = AdamW::new(&m.named_parameters(), opt_cfg.clone())?;
                let mut losses = Vec::new();
                for (x, y) in &batches {
                    let loss = m.loss(x, y)?;
                    loss.backward()?;
                    let norm = layout.grad_sq_norm(&params, &comm)?.sqrt();
                    if norm > clip {
                        let s = clip / (norm + 1e-6);
                        let _g = no_grad();
                        for (_, p) in &params {
                            if let Some(g) = p.grad() {
                                p.set_grad(Some(g.mul_scalar(s)?));
                            }
                        }
                    }
                    opt.step(3e-3)?;
                    opt.zero_grad();
                    losses.push(loss.item()?);
                }
                Ok(losses)
            })
            .unwrap();
            for (rank, l) in got.iter().enumerate() {
                for (s, (a, b)) in l.iter().zip(&want).enumerate() {
                    assert!((a - b).abs() <= 1e-4 * b.abs(), "{name} tp {tp} rank {rank} step {s}: loss {a} vs {b}\n{l:?}\n{want:?}");
                }
            }
            assert!(want[steps - 1] < want[0] - 0.1, "{name}: training did not reduce the loss: {want:?}");
        }
    }
}

#[test]
fn tp_generation_gives_the_same_tokens() {
    for (name, c) in cases() {
        let prompt = [3u32, 9, 27, 5];
        let want = {
            let m = model(&c).unwrap();
            generate(&m, &prompt, 12, 0.0, 1.0, &mut Rng::new(0)).unwrap()
        };
        let got = ThreadComm::run(2, CommOptions::default(), |comm| {
            let mut m = model(&c)?;
            parallelize(&mut m, &comm)?;
            generate(&m, &prompt, 12, 0.0, 1.0, &mut Rng::new(0))
        })
        .unwrap();
        for g in got {
            assert_eq!(g, want, "{name}: tokens differ");
        }
    }
}

/// Each rank holds only its shards: the bytes of the parameters on a rank are the model's
/// over tp (plus what is replicated), not the whole model.
#[test]
fn tp_ranks_hold_only_their_shards() {
    let c = tiny_llama_layers(3, r#","num_key_value_heads":4"#);
    let whole: usize = model(&c).unwrap().parameters().iter().map(|(_, p)| p.storage_bytes()).sum();
    let held = ThreadComm::run(2, CommOptions::default(), |comm| {
        let mut m = model(&c)?;
        parallelize(&mut m, &comm)?;
        Ok(m.parameters().iter().map(|(_, p)| p.storage_bytes()).sum::<usize>())
    })
    .unwrap();
    let norms = 4 * (2 * c.num_hidden_layers + 1) * c.hidden_size; // replicated on both ranks
    for h in held {
        assert_eq!(h, (whole - norms) / 2 + norms, "a rank holds {h} bytes of parameters, the model {whole}");
    }
}

#[test]
fn tp_refuses_indivisible_shapes() {
    let c = tiny_llama_layers(3, r#","num_key_value_heads":2,"intermediate_size":50"#);
    let errs = ThreadComm::run(4, CommOptions::default(), |comm| {
        let mut m = model(&c)?;
        Ok(parallelize(&mut m, &comm).err().map(|e| e.to_string()))
    })
    .unwrap();
    for e in errs {
        let e = e.expect("an indivisible intermediate_size was accepted");
        assert!(e.contains("intermediate_size") && e.contains("--tp 4"), "{e}");
    }
}

/// Each parameter's layout is its spec's role (`ferrolm_nn::spec`), whatever its name: a
/// column-parallel bias split with its weight's rows (by key/value head for k and v, each held by
/// two of four ranks), a row-parallel bias and the q/k norms whole on every rank, the embedding
/// split by vocabulary rows, o by input columns; a LoRA factor as its base weight's role says.
#[test]
fn layouts_follow_the_parameter_spec() {
    use ferrolm_nn::module::Factor;
    use ferrolm_parallel::tp::Sharding;
    let c = tiny_llama_layers(3, r#","num_key_value_heads":2,"model_type":"qwen3","head_dim":16,"attention_bias":true"#);
    let (tp, rank) = (4, 3);
    let specs = c.param_specs();
    let of = |name: &str| {
        let s = specs.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no {name}"));
        Sharding::of(s.role, s.units, rank, tp)
    };
    let l = "model.layers.1.self_attn";
    assert_eq!(of(&format!("{l}.q_proj.bias")), Sharding { dim: Some(0), parts: 4, index: 3, replicas: 1 });
    assert_eq!(of(&format!("{l}.k_proj.bias")), Sharding { dim: Some(0), parts: 2, index: 1, replicas: 2 });
    assert_eq!(of(&format!("{l}.k_proj.weight")), of(&format!("{l}.v_proj.bias")));
    assert_eq!(of(&format!("{l}.o_proj.weight")), Sharding { dim: Some(1), parts: 4, index: 3, replicas: 1 });
    for whole in [format!("{l}.o_proj.bias"), format!("{l}.q_norm.weight"), "model.norm.weight".into()] {
        assert_eq!(of(&whole).dim, None, "{whole}");
    }
    assert_eq!(of("model.embed_tokens.weight"), Sharding { dim: Some(0), parts: 4, index: 3, replicas: 1 });
    let linears = c.linear_specs(0);
    let factor = |i: usize, f| {
        let s = linears[i].adapter(f, 8);
        Sharding::of(s.role, s.units, rank, tp)
    };
    assert_eq!(factor(1, Factor::B), Sharding { dim: Some(0), parts: 2, index: 1, replicas: 2 }, "B of k_proj");
    assert_eq!(factor(1, Factor::A).dim, None, "A of k_proj");
    assert_eq!(factor(6, Factor::A), Sharding { dim: Some(1), parts: 4, index: 3, replicas: 1 }, "A of down_proj");
    assert_eq!(factor(6, Factor::B).dim, None, "B of down_proj");
}

/// Per-sequence log-probs (what the preference losses read) under `--tp 2` against one device:
/// the per-row head over vocabulary shards (`head_logprobs_sharded`) on packed rows, in chunks
/// of 4 and unfused, the sums of five sequences and every gradient of a random weighting of
/// them (a per-row upstream gradient).
#[test]
fn sequence_log_probs_over_vocabulary_shards_equal_single_device() {
    use ferrolm_nn::objective::{SequenceLogProbs, SequenceMap};
    let packing =
        Packing::new(9, &[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 0, 1], vec![vec![0, 4, 9], vec![0, 1, 7, 9]], Device::Cpu)
            .unwrap();
    // Token i's sequence: the segments 0..4, 4..9 | 9..10, 10..16, 16..18 (the last one padding).
    let of_token: Vec<Option<u32>> = (0..18).map(|i| [0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 3, 4, 4].map(Some)[i]).collect();
    let map = SequenceMap { of_token, sequences: 5 };
    let weights = Tensor::from_vec(vec![0.7f32, -1.3, 0.4, 2.0, 0.0], vec![5], Device::Cpu).unwrap();
    for (name, c) in cases().into_iter().take(2) {
        let (x, y) = batch(&c, 7);
        // Prompts ignored: the first two tokens of every segment, and a segment's last position.
        let t: Vec<i32> = y
            .to_vec::<i32>()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, &v)| if [0, 1, 3, 4, 5, 8, 9, 10, 11, 15, 16, 17].contains(&i) { -100 } else { v })
            .collect();
        let tg = Tokens::upload(t, vec![2, 9], Device::Cpu).unwrap();
        type Sums = (Vec<f32>, Vec<(String, Tensor)>);
        let run = |m: &mut Llama, chunks: LossChunks| -> ferrolm_tensor::Result<Sums> {
            let h = m.final_hidden(&x, Some(&packing))?;
            let s = SequenceLogProbs { chunks }.sums(m.head_op.as_ref(), m.head_weight(), &h, &tg, &map)?;
            assert_eq!(s.tokens, vec![1, 2, 0, 3, 0], "completion tokens per sequence");
            s.sums.mul(&weights)?.sum_all()?.backward()?;
            let grads = m
                .parameters()
                .into_iter()
                .map(|(n, p)| Ok((n.clone(), p.grad().ok_or_else(|| ferrolm_tensor::Error::new("test", n))?)))
                .collect::<ferrolm_tensor::Result<_>>()?;
            Ok((s.sums.to_vec::<f32>()?, grads))
        };
        let mut m = model(&c).unwrap();
        let (want, wg) = run(&mut m, LossChunks::Tokens(4)).unwrap();
        let wg: Vec<(String, Vec<f32>)> = wg.into_iter().map(|(n, g)| (n, g.to_vec::<f32>().unwrap())).collect();
        assert!(want[0] < 0.0 && want[2] == 0.0, "{name}: sums {want:?}");
        for chunks in [LossChunks::Tokens(4), LossChunks::Unfused] {
            let outs = ThreadComm::run(2, CommOptions::default(), |comm| {
                let mut m = model(&c)?;
                let layout = parallelize(&mut m, &comm)?;
                let (s, g) = run(&mut m, chunks)?;
                let g = g
                    .into_iter()
                    .map(|(n, g)| Ok((n.clone(), layout.gather(&n, &g, &comm)?.to_vec::<f32>()?)))
                    .collect::<ferrolm_tensor::Result<Vec<_>>>()?;
                Ok((s, g))
            })
            .unwrap();
            for (rank, (s, g)) in outs.iter().enumerate() {
                let e = max_rel(s, &want);
                assert!(e < TOL, "{name} {chunks:?} rank {rank}: sums {s:?} vs {want:?}");
                for ((n, g), (_, w)) in g.iter().zip(&wg) {
                    let e = max_rel(g, w);
                    assert!(e < TOL, "{name} {chunks:?} rank {rank}: gradient of {n} rel err {e}");
                }
            }
        }
    }
}
