//! `ShardSpec`: the group sizes over which parameters, gradients and optimizer states are
//! sharded (AMSP's s_p, s_g, s_os), the constraints a valid one meets, the model-state bytes it
//! leaves on a rank, and the bytes a step sends (`traffic_bytes`, which tests hold the engine to).
use ferrolm_tensor::{DType, Error, Result};

/// The dtype gradients are accumulated and reduced in (`--grad-reduce-dtype`). `F32`, the
/// default, keeps fp32 main-gradient buffers with low-precision parameters, as Megatron-LM
/// (`--accumulate-allreduce-grads-in-fp32`) and DeepSpeed do with bf16; `Bf16` accumulates and
/// reduces in the parameter dtype (bf16 for bf16 parameters: half the gradient memory and
/// traffic, rounding at every sum).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GradReduceDtype {
    #[default]
    F32,
    Bf16,
}

impl GradReduceDtype {
    /// The gradient dtype for parameters of `param`.
    pub fn dtype(self, param: DType) -> DType {
        match self {
            GradReduceDtype::F32 => DType::F32,
            GradReduceDtype::Bf16 => param,
        }
    }
    /// Bytes per gradient element for parameters of `param_bytes` bytes.
    pub fn bytes(self, param_bytes: usize) -> usize {
        match self {
            GradReduceDtype::F32 => 4,
            GradReduceDtype::Bf16 => param_bytes,
        }
    }
}

impl std::str::FromStr for GradReduceDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(GradReduceDtype::F32),
            "bf16" => Ok(GradReduceDtype::Bf16),
            _ => Err(format!("{s:?} is not a gradient reduce dtype: expected f32 or bf16")),
        }
    }
}

impl std::fmt::Display for GradReduceDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GradReduceDtype::F32 => "f32",
            GradReduceDtype::Bf16 => "bf16",
        })
    }
}

/// Group sizes over which parameters, gradients and optimizer states are sharded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardSpec {
    pub params: usize,
    pub grads: usize,
    pub optim: usize,
}

impl std::fmt::Display for ShardSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "(params {}, grads {}, optim {})", self.params, self.grads, self.optim)
    }
}

impl ShardSpec {
    /// `--zero 0|1|2|3`: plain data parallelism, ZeRO-1 (1, 1, dp), ZeRO-2 (1, dp, dp),
    /// ZeRO-3 (dp, dp, dp).
    pub fn zero(stage: usize, dp: usize) -> Result<ShardSpec> {
        Ok(match stage {
            0 => ShardSpec { params: 1, grads: 1, optim: 1 },
            1 => ShardSpec { params: 1, grads: 1, optim: dp },
            2 => ShardSpec { params: 1, grads: dp, optim: dp },
            3 => ShardSpec { params: dp, grads: dp, optim: dp },
            s => return Err(Error::new("--zero", format!("{s} is not a ZeRO stage (0, 1, 2 or 3)"))),
        })
    }

    /// MiCS: everything sharded within groups of `s` ranks, replicated across them.
    pub fn mics(s: usize) -> ShardSpec {
        ShardSpec { params: s, grads: s, optim: s }
    }

    /// AMSP's constraints, for `dp` data-parallel ranks of which `dp_per_node` share a node.
    pub fn validate(&self, dp: usize, dp_per_node: usize) -> Result<()> {
        let err = |m: String| Error::new("ShardSpec", format!("{self} with {dp} data-parallel ranks: {m}"));
        for (flag, s) in [("--shard-params", self.params), ("--shard-grads", self.grads), ("--shard-optim", self.optim)] {
            if s == 0 || !dp.is_multiple_of(s) {
                return Err(err(format!("{flag} {s} does not divide the data-parallel size {dp}")));
            }
            let dpn = dp_per_node.clamp(1, dp);
            let fits = if s <= dpn { dpn.is_multiple_of(s) } else { s % dpn == 0 };
            if !fits {
                return Err(err(format!(
                    "{flag} {s}: a group must fit inside a node ({dpn} data-parallel ranks per node) or span whole nodes"
                )));
            }
        }
        if !(self.params <= self.grads && self.grads <= self.optim) {
            return Err(err(
                "AMSP needs params <= grads <= optim: a rank must not hold gradients or optimizer states of parameters it does not hold"
                    .into(),
            ));
        }
        if self.grads != self.params && self.grads != self.optim {
            return Err(err("grads must equal params or optim (AMSP's s_g in {s_p, s_os})".into()));
        }
        if !self.optim.is_multiple_of(self.params) {
            return Err(err("optim must be a multiple of params, so that each optimizer shard lies inside one parameter shard".into()));
        }
        Ok(())
    }

    /// Every valid spec for `dp` ranks, `dp_per_node` per node.
    pub fn all_valid(dp: usize, dp_per_node: usize) -> Vec<ShardSpec> {
        let divs: Vec<usize> = (1..=dp).filter(|s| dp.is_multiple_of(*s)).collect();
        let mut out = Vec::new();
        for &p in &divs {
            for &o in &divs {
                for g in [p, o] {
                    let s = ShardSpec { params: p, grads: g, optim: o };
                    if !out.contains(&s) && s.validate(dp, dp_per_node).is_ok() {
                        out.push(s);
                    }
                }
            }
        }
        out
    }

    /// Bytes of model states per rank for `numel` (padded) parameter elements: parameters in
    /// `param_bytes` per element over s_p, gradients in the same type over s_g, and the
    /// optimizer's m, v (and an fp32 master copy for low-precision parameters) over s_os. Mixed
    /// precision (bf16): 2/s_p + 2/s_g + 12/s_os per element; f32: 4/s_p + 4/s_g + 8/s_os.
    pub fn state_bytes(&self, numel: u64, param_bytes: u64) -> u64 {
        let optim = if param_bytes == 4 { 8 } else { 12 };
        numel * param_bytes / self.params as u64 + numel * param_bytes / self.grads as u64 + numel * optim / self.optim as u64
    }
}

/// Bytes each rank sends per optimizer step (ring accounting of `cost::bytes_sent`), for
/// buckets of `bucket_numel` padded elements of `elem_bytes`, `micro` micro-batches, and
/// `gathers` parameter all-gathers per bucket per micro-batch (forward and backward; see
/// `Zero::gathers_per_micro_batch`). The gradient-norm all-reduce (8 bytes) is not included.
pub fn traffic_bytes(spec: ShardSpec, dp: usize, bucket_numel: &[usize], gathers: &[usize], elem_bytes: usize, micro: usize) -> f64 {
    let ring = |k: usize| (k as f64 - 1.0) / k as f64;
    let (sp, sg, so) = (spec.params, spec.grads, spec.optim);
    let mut total = 0.0;
    for (&n, &ag) in bucket_numel.iter().zip(gathers) {
        let b = (n * elem_bytes) as f64;
        total += micro as f64 * (ag as f64 * ring(sp) * b + ring(sg) * b);
        let rep = dp / so;
        if so > sg {
            total += ring(so / sg) * b / sg as f64 + 2.0 * ring(rep) * b / so as f64;
        } else {
            total += 2.0 * ring(rep) * b / sg as f64;
        }
        total += ring(so / sp) * b / sp as f64;
    }
    total
}
