//! `launch`: starts one process per GPU on this node with torchrun's environment, for machines
//! without torchrun (`examples/launch.rs` wraps [`run`]):
//!
//!   cargo run --release --example launch -- --nproc-per-node N <tool> <tool flags>
//!
//! and, for a job across nodes, one invocation per node with the same master address and port:
//!
//!   launch --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 --nproc-per-node 8 pretrain_llama ...
//!   launch --nnodes 2 --node-rank 1 --master-addr node0 --master-port 29500 --nproc-per-node 8 pretrain_llama ...
//!
//! (two invocations on one machine act as two simulated nodes). `<tool>` is a path to a program,
//! or the name of a ferrolm example built beside this one (`pretrain_llama`, `finetune_ladder`,
//! `eval`, `generate`). Each process gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`,
//! `GROUP_RANK`/`NODE_RANK`, `MASTER_ADDR` and `MASTER_PORT`; global rank 0 (on node 0) serves the
//! rendezvous store. If one process fails, the others of this node are stopped and the error
//! names its rank.
use super::{env_help, positive, LogArgs, Tool, ENV_COMMON};
use crate::AnyResult;
use clap::Parser;
use ferrolm_parallel::launcher::LocalLaunch;
use ferrolm_parallel::DEFAULT_MASTER_PORT;
use std::path::PathBuf;

#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    name = "launch",
    about = "Start one process per GPU on this node with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, \
             LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) and wait for them; the first failure stops the \
             others. Run it once per node, with --nnodes, --node-rank and one --master-addr/--master-port, for a job \
             across nodes.",
    trailing_var_arg = true,
    after_help = env_help(&[
        ENV_COMMON,
        "  MASTER_PORT            rendezvous port when --master-port is not given [default: a free port with\n                         --nnodes 1, else 29500]",
    ])
)]
pub struct LaunchArgs {
    /// Processes (GPUs) on this node
    #[arg(long, value_name = "N", value_parser = positive)]
    pub nproc_per_node: usize,
    /// Nodes in the job (one invocation of launch per node)
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = positive)]
    pub nnodes: usize,
    /// This node's index, 0..nnodes (node 0 runs global rank 0, which serves the rendezvous store)
    #[arg(long, value_name = "I", default_value_t = 0)]
    pub node_rank: usize,
    /// Host of node 0, reachable from every node [default: 127.0.0.1]
    #[arg(long, value_name = "HOST")]
    pub master_addr: Option<String>,
    /// Rendezvous port on the master [default: $MASTER_PORT, else a free port with --nnodes 1, else 29500]
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,
    /// Write each process's stdout and stderr to DIR/rank{R}.log [default: this terminal]
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<PathBuf>,
    #[command(flatten)]
    pub log: LogArgs,
    /// The program and its flags
    #[arg(required = true, num_args = 1.., allow_hyphen_values = true, value_name = "TOOL [FLAGS]")]
    pub command: Vec<String>,
}

impl Tool for LaunchArgs {
    fn log_args(&self) -> &LogArgs {
        &self.log
    }
}

/// A program path, or an example built beside this binary.
fn resolve(tool: &str) -> PathBuf {
    let p = PathBuf::from(tool);
    if p.components().count() > 1 || p.is_file() {
        return p;
    }
    std::env::current_exe().ok().and_then(|e| e.parent().map(|d| d.join(tool))).filter(|c| c.is_file()).unwrap_or(p)
}

fn free_port() -> AnyResult<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl LaunchArgs {
    /// The processes these flags describe: the tool resolved (a path, or an example built beside
    /// this binary), the master port chosen.
    pub fn local_launch(&self) -> AnyResult<LocalLaunch> {
        let master_port = match (self.master_port, std::env::var("MASTER_PORT")) {
            (Some(p), _) => p,
            (None, Ok(p)) => {
                p.trim().parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(|| anyhow::anyhow!("MASTER_PORT={p:?} is not a port number"))?
            }
            // One node: any free port. Several: every invocation must agree without talking.
            (None, Err(_)) if self.nnodes == 1 => free_port()?,
            (None, Err(_)) => DEFAULT_MASTER_PORT,
        };
        Ok(LocalLaunch {
            program: resolve(&self.command[0]),
            args: self.command[1..].to_vec(),
            nproc_per_node: self.nproc_per_node,
            nnodes: self.nnodes,
            node_rank: self.node_rank,
            master_addr: self.master_addr.clone().unwrap_or_else(|| "127.0.0.1".into()),
            master_port,
            env: Vec::new(),
            log_dir: self.log_dir.clone(),
        })
    }
}

/// Starts the processes of `launch` and waits for them (the first failure stops the others).
pub fn start(launch: LocalLaunch) -> AnyResult<()> {
    if let Some(d) = &launch.log_dir {
        std::fs::create_dir_all(d).map_err(|e| anyhow::anyhow!("--log-dir {}: {e}", d.display()))?;
    }
    launch.validate()?;
    let running = launch.spawn()?;
    tracing::info!(
        "started ranks {}..{} of {} ({}; rendezvous {}:{})",
        launch.node_rank * launch.nproc_per_node,
        (launch.node_rank + 1) * launch.nproc_per_node,
        launch.world_size(),
        launch.program.display(),
        launch.master_addr,
        launch.master_port
    );
    running.wait()?;
    Ok(())
}

pub fn run(a: LaunchArgs) -> AnyResult<()> {
    start(a.local_launch()?)
}
