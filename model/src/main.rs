//! `model`: the command-line front end ([`model::cli`]).

fn main() -> std::process::ExitCode {
    model::cli::main()
}
