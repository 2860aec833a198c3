//! Mixed precision as Megatron-LM and DeepSpeed do it: with bf16 parameters the engine
//! accumulates and reduces gradients in f32 main-gradient buffers by default, and in bf16 with
//! `GradReduceDtype::Bf16` (`--grad-reduce-dtype bf16`). Thread ranks, dp 2, on the CPU.
use ferrolm_nn::optim::AdamWConfig;
use ferrolm_nn::{shift_labels, Llama, LlamaConfig};
use ferrolm_parallel::zero::{GradReduceDtype, Placement, ShardSpec, Zero};
use ferrolm_parallel::{CommOptions, DeviceMesh, ThreadComm, TrainEngine};
use ferrolm_tensor::{DType, Device, Rng, Tensor};
use ferrolm_testing::tiny_gqa32;

const STEPS: usize = 2;
const ACCUM: usize = 16;
const DP: usize = 2;
const SEQ: usize = 8;

fn config() -> LlamaConfig {
    tiny_gqa32(r#","rms_norm_eps":1e-6,"tie_word_embeddings":false"#)
}

struct Run {
    /// The reduced gradients' dtype the engine reported after the first step.
    reduced: Option<DType>,
    /// Bytes of gradients the engine holds (its `state_bytes`).
    grad_bytes: usize,
    /// Rank 0's AdamW first moment after the first step: (1 - beta1) times its optimizer
    /// range's reduced gradient, in f32 whatever the parameter dtype.
    moment: Vec<f64>,
}

/// Trains `STEPS` steps of `ACCUM` micro-batches on dp 2 with ZeRO-2 and returns rank 0's view.
/// Every run starts from the same values: the bf16 initialisation (widened for f32), so that
/// the f32 run differs from the bf16 ones only in arithmetic.
fn run(dtype: DType, reduce: Option<GradReduceDtype>) -> Run {
    let out = ThreadComm::run(DP, CommOptions::default(), move |comm| {
        let mesh = DeviceMesh::new(comm, 1, DP, DP)?;
        let r = mesh.dp_rank();
        let mut m = Llama::new(config(), DType::BF16, Device::Cpu, &mut Rng::new(1))?;
        if dtype == DType::F32 {
            let low = m;
            m = Llama::new(config(), DType::F32, Device::Cpu, &mut Rng::new(1))?;
            let _g = ferrolm_tensor::no_grad();
            for ((_, p), (_, q)) in m.parameters().into_iter().zip(low.parameters()) {
                p.assign(&q)?;
            }
        }
        let mut z = Zero::new(&mut m, mesh, ShardSpec::zero(2, DP)?, None, AdamWConfig::default(), Placement::Device)?;
        if let Some(d) = reduce {
            z.set_grad_reduce_dtype(d)?;
        }
        let (mut reduced, mut moment) = (None, Vec::new());
        for s in 0..STEPS {
            for k in 0..ACCUM {
                let mut rng = Rng::new((1000 * s + 10 * k + r) as u64);
                let ids: Vec<i32> = (0..2 * SEQ).map(|_| rng.below(64) as i32).collect();
                let (x, y) = (
                    Tensor::from_vec(ids.clone(), [2, SEQ], Device::Cpu)?,
                    Tensor::from_vec(shift_labels(&ids, SEQ), [2, SEQ], Device::Cpu)?,
                );
                z.micro_batch(k + 1 == ACCUM, &mut || m.loss(&x, &y)?.mul_scalar(1.0 / ACCUM as f64))?;
            }
            z.step(1e-2, 0.0, 0.0)?;
            if s == 0 {
                reduced = z.reduced_grad_dtype();
                for i in 0..z.bucket_numel().len() {
                    moment.extend(z.optim_state(i)?.1.to_vec_f64()?);
                }
            }
        }
        Ok(Run { reduced, grad_bytes: z.state_bytes().1, moment })
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

fn distance(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt()
}

#[test]
fn bf16_parameters_reduce_gradients_in_f32_by_default_and_in_bf16_on_request() {
    let reference = run(DType::F32, None);
    let main = run(DType::BF16, None);
    let low = run(DType::BF16, Some(GradReduceDtype::Bf16));
    assert_eq!(reference.reduced, Some(DType::F32));
    assert_eq!(main.reduced, Some(DType::F32), "bf16 parameters reduce in f32 main gradients by default");
    assert_eq!(low.reduced, Some(DType::BF16), "--grad-reduce-dtype bf16 keeps bf16 gradients");
    assert_eq!(main.grad_bytes, 2 * low.grad_bytes, "f32 gradient buffers are twice the bf16 ones");
    let (d_main, d_low) = (distance(&main.moment, &reference.moment), distance(&low.moment, &reference.moment));
    println!("first-step gradient's distance to the f32 run's: f32 reduce {d_main:.3e}, bf16 reduce {d_low:.3e}");
    assert!(d_main < d_low, "f32 main gradients must follow the f32 run more closely: {d_main} vs {d_low}");
}

/// With f32 parameters both settings are the same f32 pipeline: bitwise the same weights.
#[test]
fn f32_parameters_ignore_the_setting() {
    let a = run(DType::F32, None);
    let b = run(DType::F32, Some(GradReduceDtype::Bf16));
    assert_eq!((a.reduced, b.reduced), (Some(DType::F32), Some(DType::F32)));
    assert_eq!(a.moment, b.moment);
}
