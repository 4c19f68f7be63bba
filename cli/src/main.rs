//! `dspark`: thin entry point; everything lives in the library so tests can call it.

fn main() -> std::process::ExitCode {
    dspark::run()
}
