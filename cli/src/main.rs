//! The `tether` binary: see [`tether_cli`].

fn main() -> std::process::ExitCode {
    tether_cli::main()
}
