//! Chat templates: a model's own Jinja `tokenizer.chat_template`, a template file given
//! instead, or a built-in format chosen by the model's architecture, all rendered by one
//! Jinja engine set up as Hugging Face's `apply_chat_template` sets up jinja2.

mod tool_turns;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::{Environment, Value};

use crate::error::{ModelError, Result};
use crate::template_env::{self, Clock, Raised, TEMPLATE_NAME};
use crate::tool_calls::{self, ToolCall, ToolDefinition, ToolFormat};

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The turn's text.
    pub content: String,
    /// The calls an assistant turn made (none for other turns).
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` turn answers.
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// An assistant message that made `calls` (after `content`, which may be empty).
    pub fn assistant_calls(content: impl Into<String>, calls: Vec<ToolCall>) -> Self {
        Self {
            tool_calls: calls,
            ..Self::new("assistant", content)
        }
    }

    /// A tool's result `content` for the call `call_id`.
    pub fn tool(call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            tool_call_id: Some(call_id.into()),
            ..Self::new("tool", content)
        }
    }

    /// Whether the message is part of tool use: a call or a result.
    fn uses_tools(&self) -> bool {
        !self.tool_calls.is_empty() || self.role == "tool"
    }

    /// The message as a template sees it: `role` and `content` (a string, also for an
    /// assistant turn with only calls: Qwen 3's template raises on `none` there), and
    /// `tool_calls` and `tool_call_id` only when there are some (templates test whether they
    /// are defined).
    fn template_value(&self) -> Value {
        let mut pairs = vec![
            ("role", Value::from(self.role.as_str())),
            ("content", Value::from(self.content.as_str())),
        ];
        if !self.tool_calls.is_empty() {
            let calls: Vec<Value> = self
                .tool_calls
                .iter()
                .map(ToolCall::template_value)
                .collect();
            pairs.push(("tool_calls", Value::from(calls)));
        }
        if let Some(id) = &self.tool_call_id {
            pairs.push(("tool_call_id", Value::from(id.as_str())));
        }
        Value::from_pairs(pairs)
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// An assistant message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Marker that opens a ChatML turn.
pub const IM_START: &str = "<|im_start|>";
/// Marker that closes a ChatML turn.
pub const IM_END: &str = "<|im_end|>";

/// Where a model's chat template came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TemplateSource {
    /// The model file's own `tokenizer.chat_template`.
    File,
    /// A format built into this crate, chosen by the model's architecture (named here).
    BuiltIn(&'static str),
    /// A template file given in place of the model's (`--chat-template FILE`).
    Override(PathBuf),
}

impl fmt::Display for TemplateSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TemplateSource::File => write!(f, "the model file's tokenizer.chat_template"),
            TemplateSource::BuiltIn(name) => write!(f, "built-in {name} format"),
            TemplateSource::Override(path) => write!(f, "template file {}", path.display()),
        }
    }
}

/// The chat formats built into this crate, for files that carry no template (as llama.cpp
/// keeps a built-in list). Each is Jinja text rendered by the same engine as a file's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BuiltInFormat {
    /// `<|im_start|>role\n…<|im_end|>\n` (Qwen 2 / 3, SmolLM).
    ChatMl,
    /// `<|start_header_id|>role<|end_header_id|>\n\n…<|eot_id|>` (Llama 3).
    Llama3,
    /// `<start_of_turn>user\n…<end_of_turn>\n`, the assistant as `model`, the system prompt
    /// folded into the first user turn (Gemma).
    Gemma,
    /// `<|role|>\n…<|end|>\n` (Phi-3).
    Phi3,
}

const CHATML_JINJA: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const LLAMA3_JINJA: &str = "{% for message in messages %}\
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

const GEMMA_JINJA: &str = "{% set ns = namespace(system='') %}\
{% for message in messages %}\
{% if message['role'] == 'system' %}{% set ns.system = ns.system + message['content'] | trim %}\
{% else %}\
{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}\
{{ '<start_of_turn>' + role + '\\n' }}\
{% if ns.system and role != 'model' %}{{ ns.system + '\\n\\n' }}{% set ns.system = '' %}{% endif %}\
{{ message['content'] | trim + '<end_of_turn>\\n' }}\
{% endif %}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}";

const PHI3_JINJA: &str = "{% for message in messages %}\
{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}";

impl BuiltInFormat {
    /// The format for a file of `architecture` without a template; `has_token` says whether
    /// the vocabulary holds a token (Llama-architecture files are told apart by theirs).
    /// Anything unrecognised gets ChatML, as llama.cpp's fallback is.
    pub fn for_model(architecture: &str, has_token: impl Fn(&str) -> bool) -> Self {
        match architecture {
            "gemma" | "gemma2" | "gemma3" => BuiltInFormat::Gemma,
            "phi3" => BuiltInFormat::Phi3,
            "llama" if has_token("<|start_header_id|>") => BuiltInFormat::Llama3,
            _ => BuiltInFormat::ChatMl,
        }
    }

    /// The format's name.
    pub fn name(self) -> &'static str {
        match self {
            BuiltInFormat::ChatMl => "chatml",
            BuiltInFormat::Llama3 => "llama3",
            BuiltInFormat::Gemma => "gemma",
            BuiltInFormat::Phi3 => "phi3",
        }
    }

    /// The format as Jinja text.
    pub fn jinja(self) -> &'static str {
        match self {
            BuiltInFormat::ChatMl => CHATML_JINJA,
            BuiltInFormat::Llama3 => LLAMA3_JINJA,
            BuiltInFormat::Gemma => GEMMA_JINJA,
            BuiltInFormat::Phi3 => PHI3_JINJA,
        }
    }
}

/// The special-token strings a template sees as `bos_token` and `eos_token`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// The beginning-of-sequence token's text (empty when the model has none).
    pub bos: String,
    /// The end-of-sequence token's text (empty when the model has none).
    pub eos: String,
}

/// A compiled chat template, ready to render conversations.
#[derive(Clone)]
pub struct ChatTemplate {
    jinja: Arc<str>,
    env: Arc<Environment<'static>>,
    source: TemplateSource,
    tokens: SpecialTokens,
    default_system: Option<String>,
    include_default_system: bool,
    tool_format: ToolFormat,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("tokens", &self.tokens)
            .field("default_system", &self.default_system)
            .field("include_default_system", &self.include_default_system)
            .field("tool_format", &self.tool_format)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `jinja`, which came from `source`; a template that does not compile is a
    /// [`ModelError::ChatTemplate`] naming the problem.
    pub fn new(jinja: &str, source: TemplateSource, tokens: SpecialTokens) -> Result<Self> {
        let env = template_env::compile(jinja, Clock::System)
            .map_err(|error| template_error(&source, &error))?;
        let mut template = ChatTemplate {
            jinja: Arc::from(jinja),
            env: Arc::new(env),
            default_system: chatml_default_system(jinja),
            source,
            tokens,
            include_default_system: true,
            tool_format: ToolFormat::Generic,
        };
        let tool_format =
            tool_calls::probe_format(|messages, tools| template.render_text(messages, tools, true));
        template.tool_format = tool_format;
        Ok(template)
    }

    /// A model file's own template, with empty `bos_token` / `eos_token`.
    pub fn from_jinja(jinja: &str) -> Result<Self> {
        Self::new(jinja, TemplateSource::File, SpecialTokens::default())
    }

    /// The template in the file at `path`, given in place of a model's own.
    pub fn from_file(path: &Path, tokens: SpecialTokens) -> Result<Self> {
        let source = TemplateSource::Override(path.to_path_buf());
        let jinja = std::fs::read_to_string(path).map_err(|error| ModelError::ChatTemplate {
            origin: source.to_string(),
            reason: format!("cannot read it: {error}"),
        })?;
        Self::new(&jinja, source, tokens)
    }

    /// A built-in format.
    pub fn built_in(format: BuiltInFormat, tokens: SpecialTokens) -> Result<Self> {
        Self::new(
            format.jinja(),
            TemplateSource::BuiltIn(format.name()),
            tokens,
        )
    }

    /// Built-in ChatML without special tokens.
    pub fn chatml() -> Result<Self> {
        Self::built_in(BuiltInFormat::ChatMl, SpecialTokens::default())
    }

    /// The template of a model: the file at `override_path` when given, else the model
    /// file's own `file_template`, else the built-in format of its `architecture`
    /// (see [`BuiltInFormat::for_model`]).
    pub fn for_model(
        override_path: Option<&Path>,
        file_template: Option<&str>,
        architecture: &str,
        has_token: impl Fn(&str) -> bool,
        tokens: SpecialTokens,
    ) -> Result<Self> {
        match (override_path, file_template) {
            (Some(path), _) => Self::from_file(path, tokens),
            (None, Some(jinja)) => Self::new(jinja, TemplateSource::File, tokens),
            (None, None) => {
                Self::built_in(BuiltInFormat::for_model(architecture, has_token), tokens)
            }
        }
    }

    /// Where the template came from.
    pub fn source(&self) -> &TemplateSource {
        &self.source
    }

    /// How the template's family writes tool calls (found by probing it when it was
    /// compiled): what [`ChatTemplate::render_chat`] does with tools and how answers are
    /// read for calls.
    pub fn tool_format(&self) -> ToolFormat {
        self.tool_format
    }

    /// The default system prompt the template puts first when a ChatML conversation has
    /// none (SmolLM2's has one), as written in it.
    pub fn default_system(&self) -> Option<&str> {
        self.default_system.as_deref()
    }

    /// The same template, leaving out its default system prompt: a conversation without a
    /// system turn renders without one.
    pub fn without_default_system(mut self) -> Self {
        self.include_default_system = false;
        self
    }

    /// The same template with `strftime_now` formatting the fixed UTC moment `unix_seconds`
    /// instead of the current time (for reproducible renderings).
    pub fn with_fixed_time(mut self, unix_seconds: i64) -> Result<Self> {
        let env = template_env::compile(&self.jinja, Clock::Fixed(unix_seconds))
            .map_err(|error| template_error(&self.source, &error))?;
        self.env = Arc::new(env);
        Ok(self)
    }

    /// Renders a conversation ending with the opening of the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String> {
        self.render_with(messages, true)
    }

    /// Renders a conversation, with the opening of the assistant's turn at the end when
    /// `add_generation_prompt` is set. A template that raises (`raise_exception`) or fails
    /// is a [`ModelError::ChatTemplate`] carrying its message.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_chat(messages, &[], add_generation_prompt)
    }

    /// Renders a conversation that may offer `tools` and hold calls and their results. A
    /// template of a family that writes calls in a format read here ([`ToolFormat::Hermes`],
    /// [`ToolFormat::Llama3`]) gets them as Hugging Face's `apply_chat_template` passes
    /// them: `tools` as a list (`none` when empty), each call's arguments as a mapping.
    /// Any other template gets them folded into plain turns ([`ToolFormat::Generic`]).
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        tools: &[ToolDefinition],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let uses_tools = !tools.is_empty() || messages.iter().any(ChatMessage::uses_tools);
        if self.tool_format == ToolFormat::Generic && uses_tools {
            let turns = tool_turns::fold_tools_into_turns(messages, tools);
            return self.render_without_default_system(&turns, &[], add_generation_prompt);
        }
        self.render_without_default_system(messages, tools, add_generation_prompt)
    }

    /// Renders as the template says, then takes its default system prompt out if asked to.
    fn render_without_default_system(
        &self,
        messages: &[ChatMessage],
        tools: &[ToolDefinition],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let text = self.render_text(messages, tools, add_generation_prompt)?;
        let starts_with_system = messages.first().is_some_and(|m| m.role == "system");
        if let (Some(system), false, false) = (
            &self.default_system,
            self.include_default_system,
            starts_with_system,
        ) {
            let turn = format!("{IM_START}system\n{system}{IM_END}\n");
            if let Some(rest) = text.strip_prefix(&turn) {
                return Ok(rest.to_owned());
            }
        }
        Ok(text)
    }

    /// The template's own rendering of `messages` with `tools` (`none` when empty).
    fn render_text(
        &self,
        messages: &[ChatMessage],
        tools: &[ToolDefinition],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let turns: Vec<Value> = messages.iter().map(ChatMessage::template_value).collect();
        let tools = if tools.is_empty() {
            Value::from(())
        } else {
            Value::from(
                tools
                    .iter()
                    .map(|tool| tool.template_value().clone())
                    .collect::<Vec<_>>(),
            )
        };
        let context = Value::from_pairs([
            ("messages", Value::from(turns)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("bos_token", Value::from(self.tokens.bos.as_str())),
            ("eos_token", Value::from(self.tokens.eos.as_str())),
            ("tools", tools),
            ("documents", Value::from(())),
        ]);
        self.env
            .get_template(TEMPLATE_NAME)
            .and_then(|template| template.render(context))
            .map_err(|error| template_error(&self.source, &error))
    }
}

/// The error for a template from `source` that failed: the template's own message when it
/// called `raise_exception`, else the engine's description (with the line).
fn template_error(source: &TemplateSource, error: &minijinja::Error) -> ModelError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = cause {
        if let Some(raised) = current.downcast_ref::<Raised>() {
            return ModelError::ChatTemplate {
                origin: source.to_string(),
                reason: raised.0.clone(),
            };
        }
        cause = current.source();
    }
    ModelError::ChatTemplate {
        origin: source.to_string(),
        reason: error.to_string(),
    }
}

/// The default system prompt of a ChatML template, when written in it as plain text
/// (`<|im_start|>system\n…<|im_end|>` outside any expression).
fn chatml_default_system(template: &str) -> Option<String> {
    template
        .split(IM_START)
        .skip(1)
        .find_map(|part| {
            part.strip_prefix("system\\n")
                .or_else(|| part.strip_prefix("system\n"))
        })
        .and_then(|rest| rest.split(IM_END).next())
        .map(str::to_owned)
        .filter(|text| !text.contains("{{") && !text.contains('\''))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens() -> SpecialTokens {
        SpecialTokens {
            bos: "<s>".to_owned(),
            eos: "</s>".to_owned(),
        }
    }

    fn conversation() -> Vec<ChatMessage> {
        vec![
            ChatMessage::system("Be brief."),
            ChatMessage::user(" Hi "),
            ChatMessage::assistant("Hello."),
            ChatMessage::user("Bye"),
        ]
    }

    fn built_in(format: BuiltInFormat) -> ChatTemplate {
        ChatTemplate::built_in(format, tokens()).unwrap()
    }

    #[test]
    fn chatml_renders_every_turn() {
        let template = built_in(BuiltInFormat::ChatMl);
        assert_eq!(
            template.render(&conversation()).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n\
             <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        assert_eq!(
            template
                .render_with(&[ChatMessage::user("Hi")], false)
                .unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n"
        );
        assert_eq!(template.source(), &TemplateSource::BuiltIn("chatml"));
    }

    #[test]
    fn llama3_renders_header_ids() {
        assert_eq!(
            built_in(BuiltInFormat::Llama3)
                .render(&conversation())
                .unwrap(),
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn gemma_folds_the_system_prompt_into_the_first_user_turn() {
        assert_eq!(
            built_in(BuiltInFormat::Gemma)
                .render(&conversation())
                .unwrap(),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
             <start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n\
             <start_of_turn>model\n"
        );
        assert_eq!(
            built_in(BuiltInFormat::Gemma)
                .render_with(&[ChatMessage::user("Hi")], false)
                .unwrap(),
            "<start_of_turn>user\nHi<end_of_turn>\n"
        );
    }

    #[test]
    fn phi3_renders_role_tags() {
        assert_eq!(
            built_in(BuiltInFormat::Phi3)
                .render(&conversation())
                .unwrap(),
            "<|system|>\nBe brief.<|end|>\n<|user|>\n Hi <|end|>\n<|assistant|>\nHello.<|end|>\n\
             <|user|>\nBye<|end|>\n<|assistant|>\n"
        );
    }

    #[test]
    fn formats_are_chosen_by_architecture_and_vocabulary() {
        let none = |_: &str| false;
        let llama3 = |token: &str| token == "<|start_header_id|>";
        assert_eq!(
            BuiltInFormat::for_model("gemma3", none),
            BuiltInFormat::Gemma
        );
        assert_eq!(BuiltInFormat::for_model("phi3", none), BuiltInFormat::Phi3);
        assert_eq!(
            BuiltInFormat::for_model("qwen2", none),
            BuiltInFormat::ChatMl
        );
        assert_eq!(
            BuiltInFormat::for_model("qwen3", llama3),
            BuiltInFormat::ChatMl
        );
        assert_eq!(
            BuiltInFormat::for_model("llama", llama3),
            BuiltInFormat::Llama3
        );
        assert_eq!(
            BuiltInFormat::for_model("llama", none),
            BuiltInFormat::ChatMl
        );
    }

    #[test]
    fn raise_exception_is_a_chat_template_error_with_its_message() {
        let template = ChatTemplate::from_jinja(
            "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok",
        )
        .unwrap();
        assert_eq!(template.render(&[ChatMessage::user("Hi")]).unwrap(), "ok");
        let error = template.render(&conversation()).unwrap_err();
        let ModelError::ChatTemplate { origin, reason } = &error else {
            panic!("expected a chat template error, got {error:?}");
        };
        assert_eq!(reason, "System role not supported");
        assert_eq!(origin, "the model file's tokenizer.chat_template");
    }

    #[test]
    fn a_template_that_fails_or_does_not_compile_is_an_error() {
        let error = ChatTemplate::from_jinja("{% for %}").unwrap_err();
        assert!(
            matches!(error, ModelError::ChatTemplate { .. }),
            "{error:?}"
        );
        let failing = ChatTemplate::from_jinja("{{ messages[0].content.nope.deeper }}").unwrap();
        assert!(matches!(
            failing.render(&[ChatMessage::user("Hi")]),
            Err(ModelError::ChatTemplate { .. })
        ));
    }

    #[test]
    fn an_override_beats_the_files_template() {
        let path =
            std::env::temp_dir().join(format!("meshnet-template-{}.jinja", std::process::id()));
        std::fs::write(
            &path,
            "{{ bos_token }}[{{ messages[0]['content'] }}]{{ eos_token }}",
        )
        .unwrap();
        let template = ChatTemplate::for_model(
            Some(&path),
            Some("file {{ messages[0]['content'] }}"),
            "llama",
            |_| false,
            tokens(),
        )
        .unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(template.source(), &TemplateSource::Override(path.clone()));
        assert_eq!(
            template.render(&[ChatMessage::user("Hi")]).unwrap(),
            "<s>[Hi]</s>"
        );
        let from_file = ChatTemplate::for_model(
            None,
            Some("file {{ messages[0]['content'] }}"),
            "llama",
            |_| false,
            tokens(),
        )
        .unwrap();
        assert_eq!(from_file.source(), &TemplateSource::File);
        assert_eq!(
            from_file.render(&[ChatMessage::user("Hi")]).unwrap(),
            "file Hi"
        );
        let missing = ChatTemplate::from_file(&path, tokens()).unwrap_err();
        assert!(
            missing.to_string().contains(&path.display().to_string()),
            "{missing}"
        );
    }

    #[test]
    fn the_default_system_prompt_can_be_left_out() {
        let jinja = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are nice.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let template = ChatTemplate::from_jinja(jinja).unwrap();
        assert_eq!(template.default_system(), Some("You are nice."));
        let hi = [ChatMessage::user("Hi")];
        assert_eq!(
            template.render(&hi).unwrap(),
            "<|im_start|>system\nYou are nice.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let without = template.without_default_system();
        assert_eq!(
            without.render(&hi).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let with_system = without
            .render(&[ChatMessage::system("S"), ChatMessage::user("Hi")])
            .unwrap();
        assert!(with_system.starts_with("<|im_start|>system\nS<|im_end|>\n<|im_start|>user"));
    }

    #[test]
    fn strftime_now_formats_the_fixed_moment() {
        let template = ChatTemplate::from_jinja("{{ strftime_now('%d %b %Y') }}")
            .unwrap()
            .with_fixed_time(1_735_787_045)
            .unwrap();
        assert_eq!(template.render(&[]).unwrap(), "02 Jan 2025");
    }

    #[test]
    fn formats_are_found_by_probing_the_template() {
        let hermes = "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}{% for t in tools %}{{ t.function.name }}{% endfor %}";
        let llama = "{% for t in tools or [] %}{{ t | tojson }}{% endfor %}{% for m in messages %}{% if 'tool_calls' in m %}{\"name\": \"{{ m.tool_calls[0].function.name }}\", \"parameters\": {{ m.tool_calls[0].function.arguments | tojson }}}{% else %}{{ m.content }}{% endif %}{% endfor %}";
        // Renders tools but writes calls in a syntax of its own.
        let other = "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}{% for m in messages %}{% for c in m.tool_calls or [] %}<function={{ c.function.name }}>{% endfor %}{% endfor %}";
        for (jinja, format) in [
            (hermes, ToolFormat::Hermes),
            (llama, ToolFormat::Llama3),
            (other, ToolFormat::Generic),
        ] {
            assert_eq!(
                ChatTemplate::from_jinja(jinja).unwrap().tool_format(),
                format,
                "{jinja}"
            );
        }
        assert_eq!(
            ChatTemplate::chatml().unwrap().tool_format(),
            ToolFormat::Generic
        );
    }
}
