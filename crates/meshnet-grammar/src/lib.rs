//! Structured output: constraints that keep generated tokens within a JSON Schema (or any
//! JSON object), compiled by the llguidance grammar engine.
//!
//! - [`TokenEnvironment`] is built once per model from its own tokenizer: the bytes of every
//!   token id, which ids are control tokens (they stand for no text, so no grammar allows
//!   them), and the end-of-text tokens (allowed only where the JSON is complete). It holds the
//!   engine's token trie and the compiler, shared by every request.
//! - [`TokenEnvironment::compile`] turns a [`JsonFormat`] into a [`JsonConstraint`] or a
//!   [`GrammarError::Schema`] naming what the engine could not compile.
//! - [`JsonConstraint`] is a `meshnet_model::TokenConstraint`: the generation loop asks it for
//!   the allowed tokens before each sample, commits each token taken, and stops once the JSON
//!   is complete.
//! - [`TokenEnvironment::compile_tool_calls`] compiles the calls a chat request asks for
//!   (`tool_choice` `required` or a named function) into the same kind of constraint: calls in
//!   the syntax of the template's family ([`tool_call_grammar`]), each function's arguments
//!   valid under its parameters' JSON Schema.
//!
//! The JSON it allows is written compactly with one space after `,` and `:` (`{"a": 1, "b":
//! [2, 3]}`), with no other whitespace, so a model cannot run on in spaces or newlines.
//!
//! Pure computation: no I/O, no threads of its own.

mod constraint;
mod environment;
mod error;
#[cfg(test)]
mod test_vocabulary;
mod tool_calls;

pub use constraint::{JsonConstraint, JsonFormat};
pub use environment::TokenEnvironment;
pub use error::GrammarError;
pub use tool_calls::{ToolCallSpec, tool_call_grammar};
