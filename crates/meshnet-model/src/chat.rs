//! Chat formatting for the `<|im_start|>role\n…<|im_end|>\n` (ChatML) family of templates,
//! which SmolLM2 uses.

use crate::error::{ModelError, Result};

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The turn's text.
    pub content: String,
}

impl ChatMessage {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
}

/// The chat formats this crate renders.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatTemplate {
    /// System prompt inserted when the conversation does not start with one (SmolLM2's
    /// template has one).
    pub default_system: Option<String>,
}

/// Marker that opens a turn.
pub const IM_START: &str = "<|im_start|>";
/// Marker that closes a turn.
pub const IM_END: &str = "<|im_end|>";

impl ChatTemplate {
    /// Recognises a model's Jinja chat template as the ChatML family, picking up a default
    /// system prompt written in it. Other templates are rejected.
    pub fn from_jinja(template: &str) -> Result<Self> {
        if !template.contains(IM_START) || !template.contains(IM_END) {
            return Err(ModelError::Tokenizer(
                "unsupported chat template: only the <|im_start|>role … <|im_end|> family is \
                 supported"
                    .into(),
            ));
        }
        let default_system = template
            .split(IM_START)
            .find_map(|part| {
                part.strip_prefix("system\\n")
                    .or_else(|| part.strip_prefix("system\n"))
            })
            .and_then(|rest| rest.split(IM_END).next())
            .map(str::to_owned)
            .filter(|text| !text.contains("{{") && !text.contains('\''));
        Ok(Self { default_system })
    }

    /// ChatML without a default system prompt.
    pub fn chatml() -> Self {
        Self {
            default_system: None,
        }
    }

    /// Renders a conversation, ending with the opening of the assistant's turn
    /// (`<|im_start|>assistant\n`).
    pub fn render(&self, messages: &[ChatMessage]) -> String {
        let mut text = String::new();
        let starts_with_system = messages.first().is_some_and(|m| m.role == "system");
        if let (false, Some(system)) = (starts_with_system, &self.default_system) {
            push_turn(&mut text, "system", system);
        }
        for message in messages {
            push_turn(&mut text, &message.role, &message.content);
        }
        text.push_str(IM_START);
        text.push_str("assistant\n");
        text
    }
}

fn push_turn(text: &mut String, role: &str, content: &str) {
    text.push_str(IM_START);
    text.push_str(role);
    text.push('\n');
    text.push_str(content);
    text.push_str(IM_END);
    text.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let text = ChatTemplate::chatml().render(&[ChatMessage::user("Hi")]);
        assert_eq!(
            text,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn picks_up_a_default_system_prompt() {
        let jinja = "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are nice.<|im_end|>\\n' }}{% endif %}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}";
        let template = ChatTemplate::from_jinja(jinja).unwrap();
        assert_eq!(template.default_system.as_deref(), Some("You are nice."));
        let text = template.render(&[ChatMessage::user("Hi")]);
        assert!(text.starts_with("<|im_start|>system\nYou are nice.<|im_end|>\n"));
        let with_system = template.render(&[ChatMessage::system("S"), ChatMessage::user("Hi")]);
        assert!(with_system.starts_with("<|im_start|>system\nS<|im_end|>\n<|im_start|>user"));
    }

    #[test]
    fn rejects_other_templates() {
        assert!(ChatTemplate::from_jinja("[INST] {{ message }} [/INST]").is_err());
    }
}
