//! Starts one process per GPU on this node with torchrun's environment, for machines without
//! torchrun:
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
use clap::Parser;
use ferrolm::cli::{env_help, positive, LogArgs, Tool, ENV_COMMON};
use ferrolm::AnyResult;
use ferrolm_parallel::launcher::LocalLaunch;
use ferrolm_parallel::DEFAULT_MASTER_PORT;
use std::path::PathBuf;

#[derive(Parser, Debug, Clone)]
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
struct LaunchArgs {
    /// Processes (GPUs) on this node
    #[arg(long, value_name = "N", value_parser = positive)]
    nproc_per_node: usize,
    /// Nodes in the job (one invocation of launch per node)
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = positive)]
    nnodes: usize,
    /// This node's index, 0..nnodes (node 0 runs global rank 0, which serves the rendezvous store)
    #[arg(long, value_name = "I", default_value_t = 0)]
    node_rank: usize,
    /// Host of node 0, reachable from every node [default: 127.0.0.1]
    #[arg(long, value_name = "HOST")]
    master_addr: Option<String>,
    /// Rendezvous port on the master [default: $MASTER_PORT, else a free port with --nnodes 1, else 29500]
    #[arg(long, value_name = "PORT")]
    master_port: Option<u16>,
    /// Write each process's stdout and stderr to DIR/rank{R}.log instead of this terminal
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,
    #[command(flatten)]
    log: LogArgs,
    /// The program and its flags
    #[arg(required = true, num_args = 1.., allow_hyphen_values = true, value_name = "TOOL [FLAGS]")]
    command: Vec<String>,
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

fn run(a: LaunchArgs) -> AnyResult<()> {
    let master_port = match (a.master_port, std::env::var("MASTER_PORT")) {
        (Some(p), _) => p,
        (None, Ok(p)) => {
            p.trim().parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(|| anyhow::anyhow!("MASTER_PORT={p:?} is not a port number"))?
        }
        // One node: any free port. Several: every invocation must agree without talking.
        (None, Err(_)) if a.nnodes == 1 => free_port()?,
        (None, Err(_)) => DEFAULT_MASTER_PORT,
    };
    if let Some(d) = &a.log_dir {
        std::fs::create_dir_all(d).map_err(|e| anyhow::anyhow!("--log-dir {}: {e}", d.display()))?;
    }
    let launch = LocalLaunch {
        program: resolve(&a.command[0]),
        args: a.command[1..].to_vec(),
        nproc_per_node: a.nproc_per_node,
        nnodes: a.nnodes,
        node_rank: a.node_rank,
        master_addr: a.master_addr.clone().unwrap_or_else(|| "127.0.0.1".into()),
        master_port,
        env: Vec::new(),
        log_dir: a.log_dir.clone(),
    };
    launch.validate()?;
    let running = launch.spawn()?;
    tracing::info!(
        "started ranks {}..{} of {} ({}; rendezvous {}:{})",
        a.node_rank * a.nproc_per_node,
        (a.node_rank + 1) * a.nproc_per_node,
        launch.world_size(),
        launch.program.display(),
        launch.master_addr,
        master_port
    );
    running.wait()?;
    Ok(())
}

fn main() {
    ferrolm::cli::main_with(run)
}
