//! Fine-tune a Llama or Ladder checkpoint on conversations (`--help` lists the flags; the logic
//! is `ferrolm::cli::finetune`).
//!
//!   cargo run --release --example finetune -- --model DIR --data FILE [--chat-template FILE] --steps N --out DIR
fn main() {
    ferrolm::cli::main_with(ferrolm::cli::finetune::run)
}
