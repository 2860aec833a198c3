//! The fused, chunked LM head + cross-entropy on the CUDA device (the GPU, else the CPU
//! emulator) against the CPU's on fresh random inputs, device buffers poisoned with NaN
//! (FERROLM_CUDA_POISON=1) so an unwritten element fails: f32 and bf16, a head read once or also
//! by an embedding (tied), masks that ignore most rows and a chunk that ignores all of its rows,
//! chunk sizes that do not divide the rows, the step's scale and a root gradient other than 1,
//! dW accumulated in place into an f32 gradient destination over the chunks (cuBLASLt's beta 1
//! with C = D), and the vocabulary split over two thread "ranks" on the device against one.
//! The per-row head (`head_logprobs`): its values and the gradients of a random per-row upstream
//! gradient, on one device and over two shards, against the CPU's.
//! Tolerances as in cuda.rs. With no CUDA device the tests print "skipped: no CUDA device" and
//! pass, unless FERROLM_REQUIRE_GPU=1 (or FERROLM_REQUIRE_EMU=1 without the emulator).
#[path = "../../cuda/tests/common/mod.rs"]
mod common;
mod threads;
use common::*;
use ferrolm_ops::{
    embedding_tokens, head_logprobs, head_logprobs_sharded, head_loss, head_loss_sharded, HeadLossOptions, HeadRowsOptions, LossScale,
    Tokens,
};
use ferrolm_tensor::{DType, Device, Result, Rng, Tensor};
use ferrolm_testing::poison;
use std::sync::Arc;
use threads::Threads;

const IGNORE: i32 = -100;

fn opts(chunk: usize) -> HeadLossOptions {
    HeadLossOptions { ignore_index: IGNORE, scale: LossScale::Mean, chunk_tokens: chunk }
}

/// (loss, dX, dW) of `f` on `dev` from the CPU values x and w; W's gradient goes into an f32
/// destination poisoned with NaN when `dest`.
fn run(dev: Device, x: &Tensor, w: &Tensor, dest: bool, f: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>) -> [Tensor; 3] {
    let (x, w) = (x.to_device(dev).unwrap().detach(), w.to_device(dev).unwrap().detach());
    x.set_requires_grad(true).unwrap();
    w.set_requires_grad(true).unwrap();
    let d = if dest { poison::grad_dest(&w) } else { poison::nan_filled(w.dims(), DType::F32, dev) };
    let loss = f(&x, &w).unwrap();
    loss.backward().unwrap();
    let gw = w.grad().unwrap();
    if dest {
        assert!(gw.same_view(&d) || gw.dtype() == DType::F32, "W's gradient arrives in (or for) the f32 destination");
    }
    [loss.to_device(Device::Cpu).unwrap(), x.grad().unwrap().to_device(Device::Cpu).unwrap(), gw.to_device(Device::Cpu).unwrap()]
}

fn compare(name: &str, cpu: &[Tensor; 3], gpu: &[Tensor; 3], dt: DType) {
    for (i, what) in ["loss", "dX", "dW"].into_iter().enumerate() {
        check(&format!("{name}: {what}"), &cpu[i].to_dtype(DType::F32).unwrap(), &gpu[i].to_dtype(DType::F32).unwrap(), dt, true);
    }
}

#[test]
fn head_loss_on_the_device_matches_the_cpu() {
    each_float_dtype(21, |dt, r| {
        let (n, v, c) = (48, 600, 64);
        let x = Tensor::randn([n, c], 1.0, dt, Device::Cpu, r).unwrap();
        let w = Tensor::randn([v, c], 0.3, dt, Device::Cpu, r).unwrap();
        let masks: [(&str, Vec<i32>); 3] = [
            ("none ignored", (0..n).map(|_| r.below(v as u64) as i32).collect()),
            ("most ignored", (0..n).map(|i| if i % 9 == 4 { r.below(v as u64) as i32 } else { IGNORE }).collect()),
            ("rows 13..26 ignored", (0..n).map(|i| if (13..26).contains(&i) { IGNORE } else { r.below(v as u64) as i32 }).collect()),
        ];
        let ids = Tokens::upload((0..n as i32).map(|i| (i * 37) % v as i32).collect(), [n], Device::Cpu).unwrap();
        for (what, t) in &masks {
            // (chunk, tied, scale, dW into an f32 destination)
            for (chunk, tied, scale, dest) in
                [(16, false, LossScale::Mean, false), (13, true, LossScale::Mean, true), (48, false, LossScale::Sum(0.01), true)]
            {
                let o = HeadLossOptions { scale, ..opts(chunk) };
                let f = |x: &Tensor, w: &Tensor| -> Result<Tensor> {
                    let dev = x.device();
                    let tg = Tokens::upload(t.clone(), [n], dev)?;
                    let x = match tied {
                        true => x.add(&embedding_tokens(&Tokens::upload(ids.host().unwrap().to_vec(), [n], dev)?, w)?)?,
                        false => x.clone(),
                    };
                    // A root gradient of 3 for the tied case: the op scales what it saved.
                    let l = head_loss(&x, w, &tg, &o)?;
                    if tied {
                        l.mul_scalar(3.0)
                    } else {
                        Ok(l)
                    }
                };
                let name = format!("{dt} {what}, chunks of {chunk}, tied {tied}, {scale:?}, destination {dest}");
                compare(&name, &run(Device::Cpu, &x, &w, false, &f), &run(GPU, &x, &w, dest, &f), dt);
            }
        }
    });
}

/// Rows of any length and start: 1001 logits (rows of bf16 and of f32 start at every 16-byte
/// misalignment, a scalar head and tail around the vectors of kernels/ce_row.cuh) and 5 (shorter
/// than a vector), in chunks that do not divide the rows; and 1,029 rows of 5, so the row losses
/// are summed over two of `hl_loss_partial`'s blocks of 1,024.
#[test]
fn rows_of_any_length_and_alignment_match_the_cpu() {
    each_float_dtype(24, |dt, r| {
        for (n, v, c, chunk) in [(37, 1001, 16, 10), (19, 5, 8, 7), (1029, 5, 8, 1029)] {
            let x = Tensor::randn([n, c], 1.0, dt, Device::Cpu, r).unwrap();
            let w = Tensor::randn([v, c], 0.3, dt, Device::Cpu, r).unwrap();
            let t: Vec<i32> = (0..n).map(|i| if i % 4 == 1 { IGNORE } else { r.below(v as u64) as i32 }).collect();
            let f = |x: &Tensor, w: &Tensor| head_loss(x, w, &Tokens::upload(t.clone(), [n], x.device())?, &opts(chunk));
            let name = format!("{dt} {n} rows of {v}, chunks of {chunk}");
            compare(&name, &run(Device::Cpu, &x, &w, false, &f), &run(GPU, &x, &w, true, &f), dt);
        }
    });
}

/// Two ranks holding half the vocabulary each, on the device, against the whole head on the
/// CPU: the loss, dX summed over the ranks and each rank's rows of dW (kernels/head_loss.cu).
/// Halves of 600 (bf16 rows of 300 start misaligned every other row) and of 1002 (501: f32
/// rows too).
#[test]
fn vocabulary_shards_on_the_device_match_the_whole_head() {
    each_float_dtype(22, |dt, r| {
        for (n, v, c) in [(45, 600, 32), (21, 1002, 16)] {
            shards_case(dt, r, n, v, c);
        }
    });
}

fn shards_case(dt: DType, r: &mut Rng, n: usize, v: usize, c: usize) {
    let x = Tensor::randn([n, c], 1.0, dt, Device::Cpu, r).unwrap();
    let w = Tensor::randn([v, c], 0.3, dt, Device::Cpu, r).unwrap();
    let t: Vec<i32> = (0..n).map(|i| if i % 5 == 0 || (10..20).contains(&i) { IGNORE } else { r.below(v as u64) as i32 }).collect();
    let whole = run(Device::Cpu, &x, &w, false, &|x, w| head_loss(x, w, &Tokens::upload(t.clone(), [n], Device::Cpu)?, &opts(10)));
    let got = Threads::each(2, v, |sh| {
        let wr = w.narrow(0, sh.start, v / 2).unwrap().contiguous().unwrap();
        run(GPU, &x, &wr, sh.rank == 1, &|x, w| head_loss_sharded(x, w, &Tokens::upload(t.clone(), [n], GPU)?, &opts(10), &sh))
    });
    for (rank, g) in got.iter().enumerate() {
        let rows = whole[2].narrow(0, rank * v / 2, v / 2).unwrap();
        check(&format!("{dt} V {v} rank {rank} loss"), &whole[0], &g[0], dt, true);
        check(&format!("{dt} V {v} rank {rank} dW"), &rows.to_dtype(DType::F32).unwrap(), &g[2].to_dtype(DType::F32).unwrap(), dt, true);
    }
    let dx = got[0][1].to_dtype(DType::F32).unwrap().add(&got[1][1].to_dtype(DType::F32).unwrap()).unwrap();
    check(&format!("{dt} V {v} dX summed over the ranks"), &whole[1].to_dtype(DType::F32).unwrap(), &dx, dt, true);
}

/// Without grad (eval) a chunk is its logits GEMM and its loss: the same loss.
#[test]
fn the_loss_without_grad_is_the_same() {
    let Some(_g) = gpu() else { return };
    let mut r = Rng::new(23);
    let (n, v, c) = (33, 257, 16);
    let x = Tensor::randn([n, c], 1.0, DType::F32, Device::Cpu, &mut r).unwrap();
    let w = Tensor::randn([v, c], 0.3, DType::F32, Device::Cpu, &mut r).unwrap();
    let t: Vec<i32> = (0..n).map(|i| if i % 3 == 0 { IGNORE } else { r.below(v as u64) as i32 }).collect();
    let loss = |grad: bool| {
        let _g = ferrolm_tensor::set_grad_enabled(grad);
        let (x, w) = (to_gpu(&x), to_gpu(&w));
        x.set_requires_grad(true).unwrap();
        head_loss(&x, &w, &Tokens::upload(t.clone(), [n], GPU).unwrap(), &opts(8)).unwrap()
    };
    let (a, b) = (loss(true), loss(false));
    assert!(a.requires_grad() && !b.requires_grad());
    assert_eq!(a.item().unwrap(), b.item().unwrap());
}

fn rows_opts(chunk: usize) -> HeadRowsOptions {
    HeadRowsOptions { ignore_index: IGNORE, chunk_tokens: chunk }
}

/// The per-row head on the device against the CPU: each row's log-prob (the row values come back
/// from a buffer poisoned with NaN, so an unwritten row fails) and dX, dW of Σ g · log-probs for
/// a random g (the per-row factor of ce_fused read per row); a chunk of ignored rows only, chunks
/// that do not divide the rows, a root gradient through a weighted sum.
#[test]
fn per_row_log_probs_and_gradients_on_the_device_match_the_cpu() {
    each_float_dtype(25, |dt, r| {
        let (n, v, c) = (41, 600, 32);
        let x = Tensor::randn([n, c], 1.0, dt, Device::Cpu, r).unwrap();
        let w = Tensor::randn([v, c], 0.3, dt, Device::Cpu, r).unwrap();
        let t: Vec<i32> = (0..n).map(|i| if i % 5 == 2 || (16..24).contains(&i) { IGNORE } else { r.below(v as u64) as i32 }).collect();
        let g = Tensor::randn([n], 1.0, DType::F32, Device::Cpu, r).unwrap();
        for chunk in [8, 41] {
            let values = |dev: Device| -> Tensor {
                let (x, w) = (x.to_device(dev).unwrap(), w.to_device(dev).unwrap());
                head_logprobs(&x, &w, &Tokens::upload(t.clone(), [n], dev).unwrap(), &rows_opts(chunk))
                    .unwrap()
                    .to_device(Device::Cpu)
                    .unwrap()
            };
            let name = format!("{dt} per-row, chunks of {chunk}");
            check(&format!("{name}: values"), &values(Device::Cpu), &values(GPU), dt, true);
            let f = |x: &Tensor, w: &Tensor| -> Result<Tensor> {
                let lp = head_logprobs(x, w, &Tokens::upload(t.clone(), [n], x.device())?, &rows_opts(chunk))?;
                lp.mul(&g.to_device(x.device())?)?.sum_all()
            };
            compare(&name, &run(Device::Cpu, &x, &w, false, &f), &run(GPU, &x, &w, false, &f), dt);
        }
    });
}

/// The per-row head over two vocabulary shards on the device against the whole head on the CPU
/// (kernels/head_loss.cu's hl_grad with a per-row factor).
#[test]
fn per_row_vocabulary_shards_on_the_device_match_the_whole_head() {
    each_float_dtype(26, |dt, r| {
        let (n, v, c) = (27, 600, 16);
        let x = Tensor::randn([n, c], 1.0, dt, Device::Cpu, r).unwrap();
        let w = Tensor::randn([v, c], 0.3, dt, Device::Cpu, r).unwrap();
        let t: Vec<i32> = (0..n).map(|i| if i % 4 == 0 { IGNORE } else { r.below(v as u64) as i32 }).collect();
        let g = Tensor::randn([n], 1.0, DType::F32, Device::Cpu, r).unwrap();
        let f = |x: &Tensor, w: &Tensor| -> Result<Tensor> {
            let lp = head_logprobs(x, w, &Tokens::upload(t.clone(), [n], x.device())?, &rows_opts(10))?;
            lp.mul(&g.to_device(x.device())?)?.sum_all()
        };
        let whole = run(Device::Cpu, &x, &w, false, &f);
        let got = Threads::each(2, v, |sh| {
            let wr = w.narrow(0, sh.start, v / 2).unwrap().contiguous().unwrap();
            let sh: Arc<Threads> = Arc::new(sh);
            run(GPU, &x, &wr, false, &|x, w| {
                let tg = Tokens::upload(t.clone(), [n], GPU)?;
                head_logprobs_sharded(x, w, &tg, &rows_opts(10), sh.clone())?.mul(&g.to_device(GPU)?)?.sum_all()
            })
        });
        for (rank, gr) in got.iter().enumerate() {
            let rows = whole[2].narrow(0, rank * v / 2, v / 2).unwrap();
            check(&format!("{dt} per-row rank {rank} value"), &whole[0], &gr[0], dt, true);
            check(
                &format!("{dt} per-row rank {rank} dW"),
                &rows.to_dtype(DType::F32).unwrap(),
                &gr[2].to_dtype(DType::F32).unwrap(),
                dt,
                true,
            );
        }
        let dx = got[0][1].to_dtype(DType::F32).unwrap().add(&got[1][1].to_dtype(DType::F32).unwrap()).unwrap();
        check(&format!("{dt} per-row dX summed over the ranks"), &whole[1].to_dtype(DType::F32).unwrap(), &dx, dt, true);
    });
}
