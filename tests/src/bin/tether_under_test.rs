//! The `tether` program, built for the end-to-end tests that run it as real processes.

fn main() -> std::process::ExitCode {
    tether_cli::main()
}
