//! The tool's error: a message and an exit code.
//!
//! | code | meaning |
//! |---|---|
//! | 0 | success (`replay`: identical, equal up to ties, or equal within tolerance) |
//! | 1 | `replay` found a difference |
//! | 2 | bad input: a malformed dump, an option out of range, a usage error |
//! | 3 | the environment: no GPU or no `cuda` feature, a CUDA or NVRTC failure, an I/O error |

/// Exit code of bad input or usage.
pub const BAD_INPUT: i32 = 2;
/// Exit code of a failure of the environment (device, driver, compiler, file system).
pub const ENVIRONMENT: i32 = 3;

/// A failure of the tool: one line of text and the process exit code.
#[derive(Debug)]
pub struct CliError {
    pub msg: String,
    pub code: i32,
}

impl CliError {
    /// Bad input or usage: exit code 2.
    pub fn input(msg: impl Into<String>) -> Self {
        CliError {
            msg: msg.into(),
            code: BAD_INPUT,
        }
    }

    /// No device, a driver or compiler failure, an I/O error: exit code 3.
    pub fn environment(msg: impl Into<String>) -> Self {
        CliError {
            msg: msg.into(),
            code: ENVIRONMENT,
        }
    }

    /// A library error, its message prefixed with `context` (a file name): a backend
    /// failure is the environment's, every other error names bad input.
    pub fn lib(context: &str, e: dsa_indexer::Error) -> Self {
        let msg = if context.is_empty() {
            e.to_string()
        } else {
            format!("{context}: {e}")
        };
        CliError {
            code: code_of(&e),
            msg,
        }
    }
}

/// The exit code of a library error.
fn code_of(e: &dsa_indexer::Error) -> i32 {
    match e {
        dsa_indexer::Error::Backend { .. } => ENVIRONMENT,
        _ => BAD_INPUT,
    }
}

impl From<dsa_indexer::Error> for CliError {
    fn from(e: dsa_indexer::Error) -> Self {
        CliError::lib("", e)
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError::environment(e.to_string())
    }
}

pub type Result<T, E = CliError> = std::result::Result<T, E>;

/// Return a [`CliError::input`] built with `format!`.
macro_rules! bail {
    ($($t:tt)*) => {
        return Err($crate::errors::CliError::input(format!($($t)*)))
    };
}
