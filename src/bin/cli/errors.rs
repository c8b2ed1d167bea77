//! The tool's error: a message and an exit code (2 for bad input or usage).

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
            code: 2,
        }
    }
}

impl From<dsa_indexer::Error> for CliError {
    fn from(e: dsa_indexer::Error) -> Self {
        CliError::input(e.to_string())
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError::input(e.to_string())
    }
}

pub type Result<T, E = CliError> = std::result::Result<T, E>;

/// Return a [`CliError::input`] built with `format!`.
macro_rules! bail {
    ($($t:tt)*) => {
        return Err($crate::errors::CliError::input(format!($($t)*)))
    };
}
