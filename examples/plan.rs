//! The sharding planner (AMSP's cost model over ferrolm's ZeRO engine): every valid
//! `ShardSpec` for a model and a cluster, ranked by modelled step time among those that fit.
//!
//!   cargo run --release --example plan -- --model 7b --gpus 1024 --gpus-per-node 8 --gpu-mem-gib 80
//!
//! The last line is one JSON object with the chosen layout. The tool is `ferrolm::cli::plan`.
fn main() {
    ferrolm::cli::main_with(ferrolm::cli::plan::run)
}
