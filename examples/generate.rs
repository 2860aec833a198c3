//! Sample text from a checkpoint (`--help` lists the flags; the logic is `ferrolm::cli::generate`).
//!
//!   cargo run --release --example generate -- --model DIR --prompt TEXT --max-new-tokens N
fn main() {
    ferrolm::cli::main_with(ferrolm::cli::generate::run)
}
