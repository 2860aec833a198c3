//! Convert a Hugging Face Llama checkpoint to the Ladder Transformer and fine-tune it
//! (`--help` lists the flags; the logic is `ferrolm::cli::finetune_ladder`).
//!
//!   cargo run --release --example finetune_ladder -- --model DIR --ladder-layers N|i,j,k --data FILE|DIR --steps N --out DIR
fn main() {
    ferrolm::cli::main_with(ferrolm::cli::finetune_ladder::run)
}
