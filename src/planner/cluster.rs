//! The machines a layout runs on: [`Cluster`], what the step-time and memory models read, and
//! its one constructor for a modelled GPU cluster, [`Cluster::gpu`], with one set of defaults
//! ([`GpuDefaults::DEFAULT`], each with its source). `plan` and `autoconfig --target gpu` both
//! build their cluster through it; `autoconfig --target cpu` builds thread ranks measured here
//! with [`Cluster::thread_ranks`].
use super::calibrate::Calibration;
use super::cost::{Link, LinkModel};
use anyhow::{bail, Result};

/// Bytes of memory traffic per parameter element of one AdamW update with f32 state: read the
/// parameter, its gradient, m and v, write the parameter, m and v (7 × 4 bytes). The on-device
/// update is memory bound, so its time per element is this over the memory bandwidth, and a
/// GPU's AdamW rate is the bandwidth over this.
pub const ADAMW_BYTES_PER_ELEM: f64 = 28.0;

pub const GIB: f64 = (1u64 << 30) as f64;

/// The machines.
#[derive(Clone, Debug)]
pub struct Cluster {
    pub gpus: usize,
    pub gpus_per_node: usize,
    pub mem_bytes: f64,
    pub link: LinkModel,
    /// Dense FLOP/s one rank sustains on the model's GEMMs.
    pub flops: f64,
    /// Peak FLOP/s of one rank (for MFU).
    pub peak_flops: f64,
    /// Memory kept free (allocator slack, CUDA workspace), as a fraction of `mem_bytes`.
    pub margin: f64,
    /// Fraction of overlapped communication time that still slows compute.
    pub interference: f64,
    /// Seconds the optimizer takes per parameter element it updates (on a GPU,
    /// `ADAMW_BYTES_PER_ELEM` / HBM bandwidth).
    pub update_s_per_elem: f64,
    /// Compute time the communicator itself takes per byte a rank sends (thread ranks copy and
    /// sum on the same cores as the model; 0 for NCCL, whose cost is `interference`).
    pub comm_cpu_s_per_byte: f64,
    /// Device bytes each communicator of more than one rank holds on every member: NCCL's
    /// buffers (`NCCL_BYTES_PER_COMMUNICATOR` on GPUs), 0 for thread ranks.
    pub comm_buffer_bytes: f64,
}

/// A modelled GPU cluster as a user describes it: every field but `gpus` may be left out and
/// takes [`GpuDefaults::DEFAULT`]. Bandwidths are per rank and direction.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuClusterSpec {
    pub gpus: usize,
    pub gpus_per_node: Option<usize>,
    pub gpu_mem_gib: Option<f64>,
    pub peak_tflops: Option<f64>,
    /// Sustained dense TFLOP/s per GPU on the model's GEMMs.
    pub tflops: Option<f64>,
    pub intra_gb_s: Option<f64>,
    pub inter_gb_s: Option<f64>,
    /// Latency per ring step, microseconds.
    pub intra_latency_us: Option<f64>,
    pub inter_latency_us: Option<f64>,
    pub hbm_gb_s: Option<f64>,
    pub interference: Option<f64>,
    /// Memory kept free, a fraction of the GPU's.
    pub margin: Option<f64>,
}

/// The one set of defaults of a modelled GPU cluster, each with its source.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuDefaults {
    /// 8: the GPUs of a DGX/HGX A100 or H100 node, and of AMSP's A800 nodes.
    pub gpus_per_node: usize,
    /// 80 GiB: A100/A800/H100 80 GB.
    pub gpu_mem_gib: f64,
    /// 312 TFLOP/s: A100's dense bf16 peak (NVIDIA A100 datasheet).
    pub peak_tflops: f64,
    /// 0.6: sustained GEMM throughput as a fraction of the peak, an assumption (not measured).
    pub sustained_fraction: f64,
    /// 150 GB/s: NVLink 3 (A100/A800) per GPU and direction at NCCL's bus bandwidth.
    pub intra_gb_s: f64,
    /// 25 GB/s: a DGX A100's 8 × HDR 200 Gb/s InfiniBand, one per GPU (NVIDIA DGX A100
    /// datasheet). AMSP's cluster had half (4 × HDR per node, 12.5 GB/s per GPU): its setting is
    /// given with `--inter-gb-s 12.5` (docs/PARALLEL.md).
    pub inter_gb_s: f64,
    /// 5 us per intra-node ring step: an assumption of the order NCCL's NVLink rings show.
    pub intra_latency_us: f64,
    /// 15 us per inter-node ring step: an assumption of the order of InfiniBand rings.
    pub inter_latency_us: f64,
    /// 2000 GB/s: A100 80 GB's HBM2e (2,039 GB/s, NVIDIA A100 datasheet), rounded.
    pub hbm_gb_s: f64,
    /// 0.2: the fraction of overlapped communication that still slows compute (NCCL kernels take
    /// SMs and memory bandwidth from the GEMMs); an assumption, fitted to nothing
    /// (docs/PARALLEL.md compares the result with AMSP's measurements).
    pub interference: f64,
    /// 0.1: memory kept free for allocator slack and fragmentation, an assumption.
    pub margin: f64,
}

impl GpuDefaults {
    pub const DEFAULT: GpuDefaults = GpuDefaults {
        gpus_per_node: 8,
        gpu_mem_gib: 80.0,
        peak_tflops: 312.0,
        sustained_fraction: 0.6,
        intra_gb_s: 150.0,
        inter_gb_s: 25.0,
        intra_latency_us: 5.0,
        inter_latency_us: 15.0,
        hbm_gb_s: 2000.0,
        interference: 0.2,
        margin: 0.1,
    };
}

impl Cluster {
    /// The modelled GPU cluster `s` describes, the defaults filling what it leaves out. A node
    /// holds at most the cluster's GPUs. Refuses values that are not finite and positive (the
    /// fractions: in [0, 1)), naming the flag.
    pub fn gpu(s: &GpuClusterSpec) -> Result<Cluster> {
        let d = GpuDefaults::DEFAULT;
        if s.gpus == 0 {
            bail!("--gpus must be at least 1");
        }
        let positive = |v: Option<f64>, default: f64, flag: &str| -> Result<f64> {
            let v = v.unwrap_or(default);
            if !(v.is_finite() && v > 0.0) {
                bail!("{flag} {v}: must be a finite number above 0");
            }
            Ok(v)
        };
        let fraction = |v: Option<f64>, default: f64, flag: &str| -> Result<f64> {
            let v = v.unwrap_or(default);
            if !(v.is_finite() && (0.0..1.0).contains(&v)) {
                bail!("{flag} {v}: must be a fraction in [0, 1)");
            }
            Ok(v)
        };
        let latency = |v: Option<f64>, default: f64, flag: &str| -> Result<f64> {
            let v = v.unwrap_or(default);
            if !(v.is_finite() && v >= 0.0) {
                bail!("{flag} {v}: must be a finite number of microseconds >= 0");
            }
            Ok(v / 1e6)
        };
        let per_node = s.gpus_per_node.unwrap_or(d.gpus_per_node).clamp(1, s.gpus);
        let peak = positive(s.peak_tflops, d.peak_tflops, "--peak-tflops")?;
        let sustained = positive(s.tflops, d.sustained_fraction * peak, "--tflops")?;
        let hbm = positive(s.hbm_gb_s, d.hbm_gb_s, "--hbm-gb-s")? * 1e9;
        let intra = Link::new(
            latency(s.intra_latency_us, d.intra_latency_us, "--intra-latency")?,
            positive(s.intra_gb_s, d.intra_gb_s, "--intra-gb-s")? * 1e9,
        );
        let inter = Link::new(
            latency(s.inter_latency_us, d.inter_latency_us, "--inter-latency")?,
            positive(s.inter_gb_s, d.inter_gb_s, "--inter-gb-s")? * 1e9,
        );
        Ok(Cluster {
            gpus: s.gpus,
            gpus_per_node: per_node,
            mem_bytes: positive(s.gpu_mem_gib, d.gpu_mem_gib, "--gpu-mem-gib")? * GIB,
            link: LinkModel::two_level(intra, inter, per_node),
            flops: sustained * 1e12,
            peak_flops: peak * 1e12,
            margin: fraction(s.margin, d.margin, "--margin")?,
            interference: fraction(s.interference, d.interference, "--interference")?,
            update_s_per_elem: ADAMW_BYTES_PER_ELEM / hbm,
            comm_cpu_s_per_byte: 0.0,
            comm_buffer_bytes: NCCL_BYTES_PER_COMMUNICATOR,
        })
    }

    /// Thread ranks of this machine (`ThreadComm`) behind a simulated two-level `link`, with
    /// compute, the optimizer's rate and the communicator's CPU cost measured here: no device
    /// buffers, no interference (the simulated link's "communication" is a sleep), and the
    /// measured throughput as the peak.
    pub fn thread_ranks(
        ranks: usize,
        ranks_per_node: usize,
        mem_bytes: f64,
        link: LinkModel,
        measured: &Calibration,
        margin: f64,
    ) -> Cluster {
        Cluster {
            gpus: ranks,
            gpus_per_node: ranks_per_node,
            mem_bytes,
            link,
            flops: measured.flops,
            peak_flops: measured.flops,
            margin,
            interference: 0.0,
            update_s_per_elem: measured.update_s_per_elem,
            comm_cpu_s_per_byte: measured.comm_cpu_s_per_byte,
            comm_buffer_bytes: 0.0,
        }
    }

    /// A GPU's AdamW rate, elements per second (the update is memory bound).
    pub fn gpu_adam_elems_per_s(&self) -> f64 {
        1.0 / self.update_s_per_elem
    }
}

/// NCCL's default `NCCL_BUFFSIZE`: the Simple protocol's buffer per channel and connection
/// (4 MiB, NCCL's environment-variable documentation).
pub const NCCL_BUFFSIZE: f64 = 4.0 * 1024.0 * 1024.0;
/// Channels assumed per communicator. NCCL picks them from the topology (its `NCCL_DEBUG=INFO`
/// logs show 16 to 32 on NVLink H100 nodes); 16 is a middle figure, not a measurement.
pub const NCCL_CHANNELS: f64 = 16.0;
/// Device bytes one rank holds for one NCCL communicator: per channel a ring connection to each
/// of its two neighbours, each with an `NCCL_BUFFSIZE` buffer (the LL and LL128 protocols' own
/// buffers, and NCCL's small per-communicator state, are not counted): 16 × 2 × 4 MiB = 128 MiB.
/// An assumption stated for the estimator, to be replaced by a measurement on a multi-GPU node.
pub const NCCL_BYTES_PER_COMMUNICATOR: f64 = NCCL_CHANNELS * 2.0 * NCCL_BUFFSIZE;
