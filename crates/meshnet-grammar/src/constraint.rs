//! A JSON format compiled into the token constraint the generation loop follows.

use llguidance::api::TopLevelGrammar;
use llguidance::{JsonCompileOptions, Matcher};
use meshnet_model::{ModelError, TokenConstraint, TokenMask};
use serde_json::Value;

use crate::environment::TokenEnvironment;
use crate::error::GrammarError;

/// What the generated text must be.
#[derive(Clone, Debug, PartialEq)]
pub enum JsonFormat {
    /// Any JSON object (OpenAI's `json_object`).
    AnyObject,
    /// A JSON value valid under this JSON Schema, which must be an object (OpenAI's
    /// `json_schema`).
    Schema(Value),
}

impl JsonFormat {
    /// The schema the engine compiles: the format's own, laid out compactly (one space after
    /// `,` and `:`, no other whitespace) whatever layout options it carries.
    pub(crate) fn layout_schema(&self) -> Result<Value, GrammarError> {
        let mut schema = match self {
            Self::AnyObject => serde_json::json!({"type": "object"}),
            Self::Schema(schema) => schema.clone(),
        };
        if !schema.is_object() {
            return Err(GrammarError::Schema(
                "the schema must be a JSON object".to_owned(),
            ));
        }
        let layout = JsonCompileOptions {
            item_separator: ", ".to_owned(),
            key_separator: ": ".to_owned(),
            whitespace_flexible: false,
            ..JsonCompileOptions::default()
        };
        layout.apply_to(&mut schema);
        Ok(schema)
    }
}

impl TokenEnvironment {
    /// Compiles `format` into a constraint at the start of the text. A schema the engine
    /// cannot compile (an unsupported keyword, a bad pattern, one no value satisfies, one
    /// too large) is a [`GrammarError::Schema`] saying why.
    pub fn compile(&self, format: &JsonFormat) -> Result<JsonConstraint, GrammarError> {
        self.compile_grammar(TopLevelGrammar::from_json_schema(format.layout_schema()?))
    }

    /// Compiles any grammar of the engine into a constraint at the start of the text; one
    /// it cannot compile is a [`GrammarError::Schema`] saying why.
    pub(crate) fn compile_grammar(
        &self,
        grammar: TopLevelGrammar,
    ) -> Result<JsonConstraint, GrammarError> {
        let parser = self
            .factory()
            .create_parser(grammar)
            .map_err(|error| GrammarError::Schema(schema_message(&error.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(GrammarError::Schema(error));
        }
        Ok(JsonConstraint { matcher })
    }
}

/// The engine's message about a schema, without advice about engine options a client cannot
/// set.
fn schema_message(engine_message: &str) -> String {
    engine_message.replace(
        "Enable 'coerce_one_of' option to approximate oneOf with anyOf",
        "Use anyOf, or oneOf of alternatives no value matches twice",
    )
}

/// A compiled JSON format and how far the text has come through it: the tokens allowed
/// next, the end-of-text tokens only where the JSON is complete.
#[derive(Clone)]
pub struct JsonConstraint {
    matcher: Matcher,
}

impl std::fmt::Debug for JsonConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonConstraint")
            .field("complete", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

/// The engine's failure as the model crate reports a constraint's.
fn constraint_error(error: impl std::fmt::Display) -> ModelError {
    ModelError::Constraint(error.to_string())
}

impl TokenConstraint for JsonConstraint {
    fn allowed_tokens(&mut self, mask: &mut TokenMask) -> meshnet_model::Result<()> {
        let allowed = self.matcher.compute_mask().map_err(constraint_error)?;
        mask.set_words(allowed.as_slice());
        Ok(())
    }

    fn commit(&mut self, token: u32) -> meshnet_model::Result<()> {
        self.matcher.consume_token(token).map_err(constraint_error)
    }

    fn is_complete(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }

    fn boxed_clone(&self) -> Box<dyn TokenConstraint> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::test_vocabulary::{END_OF_TEXT, IM_END, ids, token_texts, tokenizer};

    fn environment() -> TokenEnvironment {
        TokenEnvironment::new(&tokenizer(), &[END_OF_TEXT]).unwrap()
    }

    fn compile(format: JsonFormat) -> JsonConstraint {
        environment().compile(&format).unwrap()
    }

    /// The ids the constraint allows next, ascending.
    fn allowed(constraint: &mut JsonConstraint) -> Vec<u32> {
        let mut mask = TokenMask::default();
        constraint.allowed_tokens(&mut mask).unwrap();
        (0..token_texts().len() as u32)
            .filter(|&id| mask.allows(id))
            .collect()
    }

    fn commit(constraint: &mut JsonConstraint, text: &str) {
        constraint.commit(ids(&[text])[0]).unwrap();
    }

    #[test]
    fn the_tiny_vocabulary_leaves_tokenization_to_the_model() {
        // It cannot encode the probes (no "é"), so masks come from the trie alone and the
        // masks below are every token that continues the JSON.
        assert!(!environment().forces_canonical_tokens());
    }

    #[test]
    fn an_object_schema_allows_exactly_the_tokens_that_continue_it() {
        let mut constraint = compile(JsonFormat::Schema(json!({
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 2}},
            "required": ["a"],
            "additionalProperties": false,
        })));
        let steps: [(&[&str], &str); 6] = [
            (&["{", "{\""], "{\""),
            (&["a"], "a"),
            (&["\"", "\": ", "\":"], "\":"),
            (&[" "], " "),
            (&["1", "2"], "1"),
            (&["}"], "}"),
        ];
        for (expected, taken) in steps {
            assert!(!constraint.is_complete());
            assert_eq!(allowed(&mut constraint), ids(expected), "before {taken:?}");
            commit(&mut constraint, taken);
        }
        assert!(constraint.is_complete());
    }

    #[test]
    fn any_object_starts_with_a_brace_and_ends_only_when_it_closes() {
        let mut constraint = compile(JsonFormat::AnyObject);
        assert_eq!(allowed(&mut constraint), ids(&["{", "{\""]));
        commit(&mut constraint, "{");
        let next = allowed(&mut constraint);
        assert!(next.contains(&ids(&["}"])[0]) && next.contains(&ids(&["\""])[0]));
        for refused in ["{", "[", "1", " ", "a"] {
            assert!(!next.contains(&ids(&[refused])[0]), "{refused:?} after {{");
        }
        assert!(!next.contains(&END_OF_TEXT) && !next.contains(&IM_END));
        commit(&mut constraint, "}");
        assert!(constraint.is_complete());
    }

    #[test]
    fn the_end_of_text_comes_only_where_the_value_may_end_and_control_tokens_never() {
        let mut constraint = compile(JsonFormat::Schema(json!({"type": "integer"})));
        let first = allowed(&mut constraint);
        let digits: Vec<&str> = vec!["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
        let mut expected = digits.clone();
        expected.extend(["-", "12"]);
        assert_eq!(first, ids(&expected));
        commit(&mut constraint, "12");
        let mut after = digits;
        after.push("12");
        let mut expected = ids(&after);
        expected.insert(0, END_OF_TEXT);
        assert_eq!(allowed(&mut constraint), expected);
        assert!(!constraint.is_complete());
        constraint.commit(END_OF_TEXT).unwrap();
        assert!(constraint.is_complete());
    }

    #[test]
    fn control_tokens_are_never_allowed_even_where_their_text_would_be() {
        let mut constraint = compile(JsonFormat::Schema(json!({"type": "string"})));
        commit(&mut constraint, "\"");
        let inside = allowed(&mut constraint);
        // "<|im_end|>" is text a string may hold, written with other tokens.
        assert!(inside.contains(&ids(&["<"])[0]) && inside.contains(&ids(&["|"])[0]));
        assert!(!inside.contains(&IM_END) && !inside.contains(&END_OF_TEXT));
        commit(&mut constraint, "\"");
        assert!(constraint.is_complete());
    }

    #[test]
    fn a_copy_goes_on_from_where_the_original_was_and_leaves_it_there() {
        let mut original = compile(JsonFormat::AnyObject);
        commit(&mut original, "{");
        let mut copy = original.boxed_clone();
        copy.commit(ids(&["}"])[0]).unwrap();
        assert!(copy.is_complete());
        assert!(!original.is_complete());
        assert!(allowed(&mut original).contains(&ids(&["\""])[0]));
    }

    #[test]
    fn a_token_the_mask_refused_is_an_error_when_committed() {
        let mut constraint = compile(JsonFormat::AnyObject);
        let error = constraint.commit(ids(&["["])[0]).unwrap_err();
        assert!(matches!(error, ModelError::Constraint(_)), "{error}");
    }

    #[test]
    fn schemas_the_engine_cannot_compile_are_errors_saying_why() {
        let environment = environment();
        let cases = [
            (json!(true), "must be a JSON object"),
            (json!({"type": "array", "uniqueItems": true}), "uniqueItems"),
            (json!({"type": "string", "pattern": "(("}), "("),
            (
                json!({"type": "integer", "minimum": 5, "maximum": 2}),
                "nsatisfiable",
            ),
            (
                json!({"oneOf": [{"type": "integer"}, {"type": "number"}]}),
                "Use anyOf",
            ),
            (json!({"$ref": "#/$defs/missing"}), "missing"),
        ];
        for (schema, reason) in cases {
            match environment.compile(&JsonFormat::Schema(schema.clone())) {
                Err(GrammarError::Schema(message)) => {
                    assert!(message.contains(reason), "{schema}: {message}");
                }
                other => panic!("{schema}: {other:?}"),
            }
        }
    }

    /// A generator for the walks (SplitMix64).
    struct Walk(u64);

    impl Walk {
        fn pick<'a>(&mut self, from: &'a [u32]) -> &'a u32 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            &from[((z ^ (z >> 31)) % from.len() as u64) as usize]
        }
    }

    /// Checks `value` against the walk test's schema by hand.
    fn check_order(value: &Value) {
        let order = value.as_object().unwrap();
        assert!(
            order
                .keys()
                .all(|key| ["id", "items", "note", "rush"].contains(&key.as_str()))
        );
        let id = order["id"].as_str().unwrap();
        assert!(
            id.len() == 4 && id.starts_with('A') && id[1..].bytes().all(|b| b.is_ascii_digit())
        );
        let items = order["items"].as_array().unwrap();
        assert!((1..=2).contains(&items.len()));
        for item in items {
            let item = item.as_object().unwrap();
            assert_eq!(item.len(), 2);
            assert!(["ab", "b"].contains(&item["name"].as_str().unwrap()));
            assert!((1..=12).contains(&item["quantity"].as_i64().unwrap()));
        }
        if let Some(note) = order.get("note") {
            assert!(note.is_null() || (1..=5).contains(&note.as_str().unwrap().chars().count()));
        }
        assert!(order.get("rush").is_none_or(Value::is_boolean));
    }

    #[test]
    fn random_walks_through_a_schema_end_in_json_that_matches_it() {
        let mut constraint = compile(JsonFormat::Schema(json!({
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^A[0-9]{3}$"},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"enum": ["ab", "b"]},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 12},
                        },
                        "required": ["name", "quantity"],
                        "additionalProperties": false,
                    },
                },
                "note": {"type": ["string", "null"], "minLength": 1, "maxLength": 5},
                "rush": {"type": "boolean"},
            },
            "required": ["id", "items"],
            "additionalProperties": false,
        })));
        let texts = token_texts();
        for seed in 0..200 {
            let mut walk = Walk(seed);
            let mut copy = constraint.boxed_clone();
            let mut mask = TokenMask::default();
            let mut text = String::new();
            while !copy.is_complete() {
                assert!(text.len() < 400, "seed {seed}: no end after {text:?}");
                copy.allowed_tokens(&mut mask).unwrap();
                let allowed: Vec<u32> = (0..texts.len() as u32)
                    .filter(|&id| mask.allows(id))
                    .collect();
                assert!(!allowed.contains(&END_OF_TEXT) && !allowed.contains(&IM_END));
                let token = *walk.pick(&allowed);
                copy.commit(token).unwrap();
                text.push_str(&texts[token as usize]);
            }
            let value: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("seed {seed}: {text:?} is not JSON: {e}"));
            check_order(&value);
        }
        // The walks left the compiled constraint where it was.
        assert_eq!(allowed(&mut constraint), ids(&["{", "{\""]));
    }

    #[test]
    fn an_environment_needs_an_end_of_text_token_in_the_vocabulary() {
        let tokenizer = tokenizer();
        for ends in [&[][..], &[10_000]] {
            let error = TokenEnvironment::new(&tokenizer, ends).unwrap_err();
            assert!(matches!(error, GrammarError::Tokenizer(_)), "{error}");
        }
    }
}
