//! Starts one process per GPU on this node with torchrun's environment, for machines without
//! torchrun:
//!
//!   cargo run --release --example launch -- --nproc-per-node N <tool> <tool flags>
//!
//! `<tool>` is a path to a program, or the name of a ferrolm example built beside this one
//! (`pretrain_llama`, `finetune_ladder`, `eval`, `generate`). Each process gets `RANK`,
//! `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`; if one
//! fails, the others are stopped and its exit code is returned.
use clap::Parser;
use ferrolm::cli::{env_help, positive, LogArgs, Tool, ENV_COMMON};
use ferrolm::AnyResult;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "launch",
    about = "Start one process per GPU on this node with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, \
             LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and wait for them; the first failure stops the others.",
    trailing_var_arg = true,
    after_help = env_help(&[ENV_COMMON, "  MASTER_PORT            rendezvous port [default: a free port]"])
)]
struct LaunchArgs {
    /// Processes (GPUs) on this node
    #[arg(long, value_name = "N", value_parser = positive)]
    nproc_per_node: usize,
    /// Rendezvous address [default: 127.0.0.1]
    #[arg(long, value_name = "HOST")]
    master_addr: Option<String>,
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
    let program = resolve(&a.command[0]);
    let port = match std::env::var("MASTER_PORT") {
        Ok(p) => p.parse::<u16>().map_err(|_| anyhow::anyhow!("MASTER_PORT={p:?} is not a port"))?,
        Err(_) => free_port()?,
    };
    let addr = a.master_addr.clone().unwrap_or_else(|| "127.0.0.1".into());
    let n = a.nproc_per_node;
    let mut children: Vec<Child> = Vec::with_capacity(n);
    for rank in 0..n {
        let child = Command::new(&program)
            .args(&a.command[1..])
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", &addr)
            .env("MASTER_PORT", port.to_string())
            .spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                }
                anyhow::bail!("cannot start {}: {e}", program.display());
            }
        }
    }
    tracing::info!("started {n} processes of {} (rendezvous {addr}:{port})", program.display());
    // Wait for all; the first failure stops the rest.
    let mut codes: Vec<Option<i32>> = vec![None; n];
    loop {
        let mut failed = None;
        for (r, c) in children.iter_mut().enumerate() {
            if codes[r].is_none() {
                if let Some(s) = c.try_wait()? {
                    codes[r] = Some(s.code().unwrap_or(1));
                    if !s.success() && failed.is_none() {
                        failed = Some((r, s.code().unwrap_or(1)));
                    }
                }
            }
        }
        if let Some((r, code)) = failed {
            for (k, c) in children.iter_mut().enumerate() {
                if codes[k].is_none() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
            }
            anyhow::bail!("rank {r} exited with code {code}; the other ranks were stopped");
        }
        if codes.iter().all(Option::is_some) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn main() {
    ferrolm::cli::main_with(run)
}
