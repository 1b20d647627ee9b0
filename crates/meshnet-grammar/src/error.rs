//! The one error type of the crate.

/// Everything that can go wrong building a token environment or compiling a format.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The tokenizer cannot back a grammar: it has no token, or no end-of-text token.
    #[error("the tokenizer cannot be used for structured output: {0}")]
    Tokenizer(String),
    /// The grammar engine refused the token environment.
    #[error("the grammar engine refused the tokenizer: {0}")]
    Environment(String),
    /// The schema is not one the grammar engine can compile (an unsupported keyword, a bad
    /// pattern, an unsatisfiable schema, one too large); the message says what.
    #[error("{0}")]
    Schema(String),
}
