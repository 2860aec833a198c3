//! Starting the processes of one node with torchrun's environment, for machines without
//! torchrun (the `launch` example). Several invocations with `nnodes > 1` and one master address
//! and port make one job across nodes (or "simulated nodes" on one machine): global rank 0, on
//! node 0, serves the rendezvous store.
use ferrolm_tensor::{bail, Error, Result};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

/// Variables a process may have inherited from an enclosing torchrun, which would make our
/// ranks look for an agent's store: the launched processes get them removed.
const TORCHRUN_ONLY: [&str; 4] =
    ["TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS"];

/// One node's share of a job: `nproc_per_node` processes of `program args`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalLaunch {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Variables added to every process's environment.
    pub env: Vec<(String, String)>,
    /// Where each process's stdout and stderr go (`rank{R}.log`); `None`: this terminal.
    pub log_dir: Option<PathBuf>,
}

impl LocalLaunch {
    /// `nproc_per_node` processes of `program` on one node, rendezvous on 127.0.0.1:`master_port`.
    pub fn one_node(program: impl Into<PathBuf>, args: Vec<String>, nproc_per_node: usize, master_port: u16) -> LocalLaunch {
        LocalLaunch {
            program: program.into(),
            args,
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port,
            env: Vec::new(),
            log_dir: None,
        }
    }

    /// The log file of global rank `rank` under `log_dir`.
    pub fn log_path(&self, rank: usize) -> Option<PathBuf> {
        self.log_dir.as_ref().map(|d| d.join(format!("rank{rank}.log")))
    }

    pub fn validate(&self) -> Result<()> {
        if self.nproc_per_node == 0 || self.nnodes == 0 {
            bail!("launch", "--nproc-per-node and --nnodes must be at least 1");
        }
        if self.node_rank >= self.nnodes {
            bail!("launch", "--node-rank {} is not below --nnodes {}", self.node_rank, self.nnodes);
        }
        if self.master_port == 0 {
            bail!("launch", "--master-port 0 is not a port the other nodes can reach");
        }
        Ok(())
    }

    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// The environment of this node's process `local_rank`.
    pub fn process_env(&self, local_rank: usize) -> Vec<(&'static str, String)> {
        let rank = self.node_rank * self.nproc_per_node + local_rank;
        vec![
            ("RANK", rank.to_string()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("WORLD_SIZE", self.world_size().to_string()),
            ("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string()),
            ("GROUP_RANK", self.node_rank.to_string()),
            ("NODE_RANK", self.node_rank.to_string()),
            ("GROUP_WORLD_SIZE", self.nnodes.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
        ]
    }

    /// Starts this node's processes.
    pub fn spawn(&self) -> Result<Running> {
        self.validate()?;
        let mut children = Vec::with_capacity(self.nproc_per_node);
        for local in 0..self.nproc_per_node {
            let mut cmd = Command::new(&self.program);
            cmd.args(&self.args);
            for v in TORCHRUN_ONLY {
                cmd.env_remove(v);
            }
            cmd.envs(self.process_env(local)).envs(self.env.iter().map(|(k, v)| (k, v)));
            if let Some(path) = self.log_path(self.node_rank * self.nproc_per_node + local) {
                let log = std::fs::File::create(&path).and_then(|f| Ok((f.try_clone()?, f)));
                match log {
                    Ok((out, err)) => {
                        cmd.stdout(out).stderr(err);
                    }
                    Err(e) => {
                        let mut started = Running { children, node_rank: self.node_rank, nproc_per_node: self.nproc_per_node };
                        started.stop_all();
                        bail!("launch", "cannot create the log file {}: {e}", path.display());
                    }
                }
            }
            match cmd.spawn() {
                Ok(c) => children.push(c),
                Err(e) => {
                    let mut started = Running { children, node_rank: self.node_rank, nproc_per_node: self.nproc_per_node };
                    started.stop_all();
                    bail!("launch", "cannot start {}: {e}", self.program.display());
                }
            }
        }
        Ok(Running { children, node_rank: self.node_rank, nproc_per_node: self.nproc_per_node })
    }

    /// Starts the processes and waits for them; the first failure stops the others of this node
    /// (the other nodes' ranks learn of it through the store's failure notice, or time out).
    pub fn run(&self) -> Result<()> {
        self.spawn()?.wait()
    }
}

/// The running processes of one node.
pub struct Running {
    children: Vec<Child>,
    node_rank: usize,
    nproc_per_node: usize,
}

fn describe(s: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = s.signal() {
            return format!("was killed by signal {sig}");
        }
    }
    format!("exited with code {}", s.code().unwrap_or(-1))
}

impl Running {
    /// Process ids, by local rank.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Child::id).collect()
    }

    fn stop_all(&mut self) {
        for c in &mut self.children {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }

    /// Waits for every process; at the first failure stops the rest and returns an error that
    /// names the global rank (every rank found failed in the same poll, which cannot tell
    /// their order).
    pub fn wait(mut self) -> Result<()> {
        let mut done = vec![false; self.children.len()];
        loop {
            let mut failed = Vec::new();
            for (local, (child, done)) in self.children.iter_mut().zip(&mut done).enumerate() {
                if *done {
                    continue;
                }
                let status = child.try_wait().map_err(|e| Error::new("launch", format!("cannot wait for local rank {local}: {e}")))?;
                let Some(status) = status else { continue };
                *done = true;
                if !status.success() {
                    let rank = self.node_rank * self.nproc_per_node + local;
                    failed.push(format!("rank {rank} (local rank {local} of node {}) {}", self.node_rank, describe(status)));
                }
            }
            if !failed.is_empty() {
                self.stop_all();
                bail!("launch", "{}; the other ranks of this node were stopped", failed.join(", "));
            }
            if done.iter().all(|&d| d) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // An early return (the caller's error) must not leave processes behind.
        self.stop_all();
    }
}
