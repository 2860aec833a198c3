//! The flags that describe a modelled GPU cluster, shared by `plan` and `autoconfig` so both
//! build it through the one constructor, `planner::Cluster::gpu`, with the same defaults
//! (`planner::GpuDefaults`, whose sources the help repeats), and `--grad-reduce-dtype` as the
//! training tools take it.
use crate::planner::{Cluster, GpuClusterSpec};
use crate::AnyResult;
use clap::Args;
use ferrolm_parallel::zero::GradReduceDtype;

#[derive(Args, Debug, Clone, Default, PartialEq)]
pub struct GpuClusterArgs {
    /// GPUs per node [default: 8]
    #[arg(long, value_parser = super::positive, help_heading = "Cluster")]
    pub gpus_per_node: Option<usize>,
    /// Memory per GPU, GiB [default: 80, A100/A800/H100 80 GB]
    #[arg(long, help_heading = "Cluster")]
    pub gpu_mem_gib: Option<f64>,
    /// Peak dense bf16 TFLOP/s per GPU, for MFU [default: 312, A100]
    #[arg(long, help_heading = "Cluster")]
    pub peak_tflops: Option<f64>,
    /// Intra-node bandwidth per rank and direction, GB/s [default: 150, NVLink 3 (A100/A800) at
    /// NCCL's bus bandwidth]
    #[arg(long, value_name = "GB/S", alias = "intra-bw", help_heading = "Cluster")]
    pub intra_gb_s: Option<f64>,
    /// Inter-node bandwidth per rank and direction, GB/s [default: 25, DGX A100: 8 x HDR 200 Gb/s
    /// per 8 GPUs; AMSP's cluster: 12.5]
    #[arg(long, value_name = "GB/S", alias = "inter-bw", help_heading = "Cluster")]
    pub inter_gb_s: Option<f64>,
    /// Intra-node latency per ring step, microseconds [default: 5]
    #[arg(long, value_name = "US", help_heading = "Cluster")]
    pub intra_latency: Option<f64>,
    /// Inter-node latency per ring step, microseconds [default: 15]
    #[arg(long, value_name = "US", help_heading = "Cluster")]
    pub inter_latency: Option<f64>,
    /// GPU memory bandwidth, GB/s (the on-device optimizer update is memory bound)
    /// [default: 2000, A100 80 GB]
    #[arg(long, help_heading = "Cluster")]
    pub hbm_gb_s: Option<f64>,
    /// Fraction of overlapped communication that still slows compute [default: 0.2]
    #[arg(long, value_parser = super::fraction, help_heading = "Cluster")]
    pub interference: Option<f64>,
}

impl GpuClusterArgs {
    /// The flags given on the command line, by name.
    pub fn given(&self) -> Vec<&'static str> {
        let given = [
            ("--gpus-per-node", self.gpus_per_node.is_some()),
            ("--gpu-mem-gib", self.gpu_mem_gib.is_some()),
            ("--peak-tflops", self.peak_tflops.is_some()),
            ("--intra-gb-s", self.intra_gb_s.is_some()),
            ("--inter-gb-s", self.inter_gb_s.is_some()),
            ("--intra-latency", self.intra_latency.is_some()),
            ("--inter-latency", self.inter_latency.is_some()),
            ("--hbm-gb-s", self.hbm_gb_s.is_some()),
            ("--interference", self.interference.is_some()),
        ];
        given.into_iter().filter(|g| g.1).map(|g| g.0).collect()
    }

    /// The cluster description: these flags, `gpus`, the sustained TFLOP/s and the margin.
    pub fn spec(&self, gpus: usize, tflops: Option<f64>, margin: f64) -> GpuClusterSpec {
        GpuClusterSpec {
            gpus,
            gpus_per_node: self.gpus_per_node,
            gpu_mem_gib: self.gpu_mem_gib,
            peak_tflops: self.peak_tflops,
            tflops,
            intra_gb_s: self.intra_gb_s,
            inter_gb_s: self.inter_gb_s,
            intra_latency_us: self.intra_latency,
            inter_latency_us: self.inter_latency,
            hbm_gb_s: self.hbm_gb_s,
            interference: self.interference,
            margin: Some(margin),
        }
    }

    /// The modelled cluster, through `Cluster::gpu`.
    pub fn cluster(&self, gpus: usize, tflops: Option<f64>, margin: f64) -> AnyResult<Cluster> {
        Cluster::gpu(&self.spec(gpus, tflops, margin))
    }
}

/// `--grad-reduce-dtype`, as the training tools take it (`cli::parallel`), for the tools that
/// model a run: the dtype its gradients are accumulated and reduced in, which prices the
/// gradient collectives (4 bytes per element for f32, the parameters' 2 for bf16).
#[derive(Args, Debug, Clone, Copy, Default, PartialEq)]
pub struct GradReduceArg {
    /// The dtype gradients are accumulated and reduced in, as the modelled run would take it:
    /// f32 main gradients (the training tools' default) or bf16, the parameter dtype (half the
    /// gradient memory and traffic)
    #[arg(long, value_name = "f32|bf16", default_value = "f32")]
    pub grad_reduce_dtype: GradReduceDtype,
}
