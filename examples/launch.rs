//! Starts one process per GPU on this node with torchrun's environment, for machines without
//! torchrun (`--help` lists the flags; the logic is `ferrolm::cli::launch`).
//!
//!   cargo run --release --example launch -- --nproc-per-node N <tool> <tool flags>
fn main() {
    ferrolm::cli::main_with(ferrolm::cli::launch::run)
}
