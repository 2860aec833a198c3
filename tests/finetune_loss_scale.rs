//! The loss of a step is normalised over the whole step (issue 42 item 6): the sum of the
//! per-token cross-entropy over the trained tokens of every micro-batch on every data-parallel
//! rank, divided by their count. With micro-batches whose trained-token counts differ tenfold,
//! `--grad-accum 4 --dp 2` (one row a micro-batch) must give the gradient of the same eight
//! rows run as one batch, and that gradient must be the one of the token-mean loss over all of
//! them (a mean of the micro-batches' means would weigh a 1-token row like a 12-token one).
//!
//! The gradient is read back from AdamW's first moment after one step without clipping:
//! exp_avg = (1 - beta1) g. The step's reported gradient norm (before clipping) must agree too.
mod common;
use common::*;
use ferrolm::data::chat::{pack, Example, PackOptions, PackedData, PackedRow};
use ferrolm::train::{TrainSet, Trainer};
use ferrolm::{DType, Device, Llama, Tensor};
use ferrolm_parallel::{CommOptions, ThreadComm};
use ferrolm_tensor::Rng;
use std::collections::BTreeMap;
use std::path::Path;

const T: usize = 16;

/// Eight conversations, one a row (`--no-pack`; some padded): 1 or 10-14 trained targets each.
fn data(vocab: usize) -> PackedData {
    let mut rng = Rng::new(11);
    // (conversation length, trained tokens at its end)
    let shapes = [(16, 1), (16, 12), (10, 1), (12, 10), (16, 14), (9, 1), (16, 2), (14, 11)];
    let examples = shapes
        .iter()
        .map(|&(len, trained)| Example {
            ids: (0..len).map(|_| (rng.next_u64() % vocab as u64) as u32).collect(),
            trained: (0..len).map(|j| j + trained >= len).collect(),
        })
        .collect();
    pack(examples, &PackOptions { seq_len: T, pack: false, truncate: false, pad_id: 0 }).unwrap()
}

fn options(batch: usize, accum: usize) -> ferrolm::train::TrainOptions {
    let mut o = opts(1);
    o.batch_size = batch;
    o.grad_accum = accum;
    o.seq_len = T;
    o.grad_clip = 0.0; // the first moment is then exactly (1 - beta1) times the gradient
    o
}

/// One step of `data` on `dp` thread ranks: the full first moments by parameter, and the
/// reported gradient norm.
fn one_step(
    dir: &Path,
    name: &str,
    data: &TrainSet,
    batch: usize,
    accum: usize,
    dp: usize,
    vocab: usize,
) -> (BTreeMap<String, Vec<f64>>, f64) {
    let o = options(batch, accum);
    let layout = ferrolm::parallel::Parallelism {
        dp,
        spec: ferrolm_parallel::zero::ShardSpec::zero(2, dp).unwrap(),
        ..ferrolm::parallel::Parallelism::single()
    };
    let e = |e: anyhow::Error| ferrolm::Error::new("test", format!("{e:#}"));
    let run = |comm| -> ferrolm::Result<(BTreeMap<String, Vec<f64>>, f64)> {
        let mut model = Llama::new(config(vocab, 2), DType::F32, Device::Cpu, &mut Rng::new(1))?;
        let engine = ferrolm::parallel::attach(&mut model, comm, &layout, Trainer::adamw_config(&o)).map_err(e)?;
        let mut t = Trainer::with_engine_on(model, Box::new(engine), data, o.clone(), &dir.join(name)).map_err(e)?;
        let (_, norm, _) = t.train_step().map_err(e)?;
        let ck = t.save_checkpoint().map_err(e)?;
        let (_, state) = ferrolm_parallel::zero::ckpt::load_full(&ck)?;
        let m = state.iter().filter_map(|(n, x)| Some((n.strip_prefix("exp_avg.")?.to_string(), x.to_vec_f64().ok()?))).collect();
        Ok((m, norm))
    };
    if dp == 1 {
        return run(None).unwrap();
    }
    ThreadComm::run(dp, CommOptions::default(), |c| run(Some(c))).unwrap().swap_remove(0)
}

#[test]
fn grad_accum_4_dp_2_gives_the_gradient_of_one_batch_of_the_same_rows() {
    let dir = tmp("ft-loss-scale");
    let vocab = ferrolm::data::Tokenizer::from_file(tokenizer_path()).unwrap().vocab_size();
    let data = data(vocab);
    let rows: Vec<PackedRow> = (0..data.num_rows()).map(|i| data.row(i)).collect();
    let counts: Vec<usize> = rows.iter().map(|r| r.trained_tokens()).collect();
    let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
    assert!(*hi >= 10 * lo, "micro-batches must differ tenfold in trained tokens: {counts:?}");
    let data = TrainSet::Rows { train: std::sync::Arc::new(data), val: None };

    let (split, split_norm) = one_step(&dir, "dp2-accum4", &data, 1, 4, 2, vocab);
    let (whole, whole_norm) = one_step(&dir, "one-batch", &data, 8, 1, 1, vocab);

    // The gradient of the token-mean loss of the eight rows as one batch, directly.
    let model = Llama::new(config(vocab, 2), DType::F32, Device::Cpu, &mut Rng::new(1)).unwrap();
    let ids: Vec<i32> = rows.iter().flat_map(|r| r.ids.iter().map(|&i| i as i32)).collect();
    let targets: Vec<i32> = rows.iter().flat_map(|r| r.targets.clone()).collect();
    let x = Tensor::from_vec(ids, [8, T], Device::Cpu).unwrap();
    let y = Tensor::from_vec(targets, [8, T], Device::Cpu).unwrap();
    model.loss(&x, &y).unwrap().backward().unwrap();
    let mut direct_sq = 0.0;
    for (name, p) in model.parameters() {
        let g = p.grad().unwrap().to_vec_f64().unwrap();
        direct_sq += g.iter().map(|v| v * v).sum::<f64>();
        let scale = g.iter().fold(0.0f64, |a, v| a.max(v.abs()));
        for (run, m) in [("one batch", &whole), ("--grad-accum 4 --dp 2", &split)] {
            let m = &m[&name];
            assert_eq!(m.len(), g.len(), "{name}");
            for (i, (mi, gi)) in m.iter().zip(&g).enumerate() {
                let got = mi / 0.1; // exp_avg = (1 - beta1) g, beta1 = 0.9
                assert!((got - gi).abs() <= 2e-5 * scale, "{run}: {name}[{i}]: gradient {got} vs {gi} (largest {scale})");
            }
        }
    }
    let direct = direct_sq.sqrt();
    for (run, n) in [("one batch", whole_norm), ("--grad-accum 4 --dp 2", split_norm)] {
        assert!((n - direct).abs() <= 1e-5 * direct, "{run}: gradient norm {n} vs {direct}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
