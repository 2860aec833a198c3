//! Preference-tune (DPO and its siblings) a Llama or Ladder checkpoint on preference pairs
//! (`--help` lists the flags; the logic is `ferrolm::cli::dpo`).
//!
//!   cargo run --release --example dpo -- --model DIR --data FILE [--beta 0.1] [--loss-type sigmoid] --steps N --out DIR
fn main() {
    ferrolm::cli::main_with(ferrolm::cli::dpo::run)
}
