//! Pretrain a LLaMA model (`--help` lists the flags; the logic is `ferrolm::cli::pretrain`).
//!
//!   cargo run --release --example pretrain_llama -- [FLAGS]
fn main() {
    ferrolm::cli::main_with(ferrolm::cli::pretrain::run)
}
