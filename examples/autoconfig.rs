//! Auto-configurator: model size from a budget, base hyper-parameters, and the fastest layout
//! that fits, modelled and (on CPU thread ranks) measured (`--help` lists the flags; the logic
//! is `ferrolm::cli::autoconfig`).
//!
//!   cargo run --release --example autoconfig -- [FLAGS]
fn main() {
    ferrolm::cli::main_with(ferrolm::cli::autoconfig::run)
}
