//! Parsing and validating request bodies by hand, so every failure names its field.
//!
//! Fields set to JSON `null` count as absent, and fields this API does not know are ignored.

use serde_json::{Map, Value};

use meshnet_types::SamplingConfig;

use crate::engine::{ChatTurn, JsonSchemaFormat, PromptInput, ResponseFormat, ToolRequest};
use crate::error::ApiError;

pub(crate) mod tools;

/// The largest request body accepted, in bytes; larger bodies get 413.
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// The most stop sequences a request may carry.
pub const MAX_STOP_SEQUENCES: usize = 4;

/// The largest bias `logit_bias` may give a token; its negative bans the token.
const MAX_LOGIT_BIAS: f64 = 100.0;

/// The largest `presence_penalty` and `frequency_penalty`; their negatives are the smallest.
const MAX_PENALTY: f64 = 2.0;

/// The most choices `n` may ask for.
pub const MAX_CHOICES: usize = 8;

/// The most alternatives `top_logprobs` may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The largest `max_draft` a request may give.
pub const MAX_DRAFT_LIMIT: usize = 64;

/// The longest `response_format.json_schema.name`.
const MAX_FORMAT_NAME: usize = 64;

/// Which endpoint a body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Text,
}

/// A request that passed validation.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ParsedRequest {
    /// One prompt (a chat, or a completion's), or a completion's several prompts.
    pub prompts: Vec<PromptInput>,
    pub max_tokens: Option<usize>,
    pub sampling: SamplingConfig,
    pub logprobs: Option<usize>,
    pub stop: Vec<String>,
    pub n: usize,
    pub echo: bool,
    pub response_format: ResponseFormat,
    pub stream: bool,
    pub include_usage: bool,
    pub tools: Option<ToolRequest>,
    pub max_draft: Option<usize>,
}

/// Parses `body` sent to `endpoint`, checking `model` against `model_id` and token ids
/// against a vocabulary of `vocab_size` ids.
pub(crate) fn parse(
    endpoint: Endpoint,
    body: &[u8],
    model_id: &str,
    vocab_size: usize,
) -> Result<ParsedRequest, ApiError> {
    let map = json_object(body)?;
    let fields = Fields(&map);

    let model = fields
        .string("model")?
        .ok_or_else(|| ApiError::invalid(Some("model"), "Missing required parameter: 'model'."))?;
    if model != model_id {
        return Err(ApiError::ModelNotFound(model.to_owned()));
    }

    let prompts = match endpoint {
        Endpoint::Chat => vec![PromptInput::Chat(parse_messages(&fields)?)],
        Endpoint::Text => parse_prompt(&fields, vocab_size)?,
    };
    let tools = match endpoint {
        Endpoint::Chat => tools::parse_tool_request(&fields, body)?,
        Endpoint::Text => None,
    };

    let max_tokens = match endpoint {
        Endpoint::Chat => {
            let legacy = fields.positive_int("max_tokens")?;
            fields.positive_int("max_completion_tokens")?.or(legacy)
        }
        Endpoint::Text => fields.positive_int("max_tokens")?,
    };
    let sampling = parse_sampling(&fields, vocab_size)?;
    let logprobs = parse_logprobs(endpoint, &fields)?;
    let stop = parse_stop(&fields)?;
    let n = parse_n(&fields)?;
    if prompts.len() * n > MAX_CHOICES {
        return Err(ApiError::invalid(
            Some("n"),
            format!(
                "Invalid 'n': {n} choices for each of {} prompts make more than {MAX_CHOICES}.",
                prompts.len()
            ),
        ));
    }
    let echo = match endpoint {
        Endpoint::Text => fields.bool("echo")?.unwrap_or(false),
        Endpoint::Chat => false,
    };
    let response_format = parse_response_format(&fields)?;
    let stream = fields.bool("stream")?.unwrap_or(false);
    let include_usage = parse_include_usage(&fields)?;
    let max_draft = parse_max_draft(&fields)?;

    Ok(ParsedRequest {
        prompts,
        max_tokens,
        sampling,
        logprobs,
        stop,
        n,
        echo,
        response_format,
        stream,
        include_usage,
        tools,
        max_draft,
    })
}

/// `response_format`: `{"type": "text"}`, `{"type": "json_object"}`, or `{"type":
/// "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}`.
fn parse_response_format(fields: &Fields<'_>) -> Result<ResponseFormat, ApiError> {
    let format = match fields.get("response_format") {
        None => return Ok(ResponseFormat::Text),
        Some(Value::Object(format)) => Fields(format),
        Some(v) => return Err(type_error("response_format", "an object", v)),
    };
    let kind = format
        .string_at("response_format", "type")?
        .ok_or_else(|| missing("response_format.type"))?;
    match kind {
        "text" => Ok(ResponseFormat::Text),
        "json_object" => Ok(ResponseFormat::JsonObject),
        "json_schema" => match format.get("json_schema") {
            Some(Value::Object(json_schema)) => {
                parse_json_schema(&Fields(json_schema)).map(ResponseFormat::JsonSchema)
            }
            Some(v) => Err(type_error("response_format.json_schema", "an object", v)),
            None => Err(missing("response_format.json_schema")),
        },
        other => Err(ApiError::invalid(
            Some("response_format.type"),
            format!(
                "Invalid value: '{other}'. Supported values are: 'text', 'json_object' and \
                 'json_schema'."
            ),
        )),
    }
}

/// `response_format.json_schema`'s fields: a valid `name`, an object `schema`, and the
/// optional `strict` and `description`.
fn parse_json_schema(fields: &Fields<'_>) -> Result<JsonSchemaFormat, ApiError> {
    let at = "response_format.json_schema";
    let name = fields
        .string_at(at, "name")?
        .ok_or_else(|| missing("response_format.json_schema.name"))?;
    let name_is_valid = (1..=MAX_FORMAT_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !name_is_valid {
        return Err(ApiError::invalid(
            Some("response_format.json_schema.name"),
            format!(
                "Invalid 'response_format.json_schema.name': '{name}' must be 1 to \
                 {MAX_FORMAT_NAME} characters of a-z, A-Z, 0-9, '_' and '-'."
            ),
        ));
    }
    let schema = match fields.get("schema") {
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(v) => {
            return Err(type_error(
                "response_format.json_schema.schema",
                "an object",
                v,
            ));
        }
        None => return Err(missing("response_format.json_schema.schema")),
    };
    let strict = fields
        .get("strict")
        .map(|v| {
            v.as_bool()
                .ok_or_else(|| type_error("response_format.json_schema.strict", "a boolean", v))
        })
        .transpose()?
        .unwrap_or(false);
    let description = fields.string_at(at, "description")?.map(str::to_owned);
    Ok(JsonSchemaFormat {
        name: name.to_owned(),
        description,
        schema,
        strict,
    })
}

/// The 400 for a required parameter that is absent.
fn missing(param: &str) -> ApiError {
    ApiError::invalid(
        Some(param),
        format!("Missing required parameter: '{param}'."),
    )
}

/// The sampling settings: `temperature` (default 1), `top_p`, `top_k`, `min_p`, the two
/// penalties, `logit_bias`, and `seed` (a random one when absent).
fn parse_sampling(fields: &Fields<'_>, vocab_size: usize) -> Result<SamplingConfig, ApiError> {
    Ok(SamplingConfig {
        temperature: fields
            .number_between("temperature", 0.0, 2.0)?
            .unwrap_or(1.0) as f32,
        top_p: fields.top_p()?,
        top_k: fields.positive_int("top_k")?,
        min_p: fields.number_between("min_p", 0.0, 1.0)?.map(|p| p as f32),
        presence_penalty: fields.penalty("presence_penalty")?,
        frequency_penalty: fields.penalty("frequency_penalty")?,
        logit_bias: parse_logit_bias(fields, vocab_size)?,
        seed: fields.seed()?.unwrap_or_else(random_seed),
    })
}

/// A seed for a request that gave none.
fn random_seed() -> u64 {
    let (high, low) = uuid::Uuid::new_v4().as_u64_pair();
    high ^ low
}

/// `n`: how many choices, `1..=MAX_CHOICES` (default 1).
fn parse_n(fields: &Fields<'_>) -> Result<usize, ApiError> {
    Ok(fields.int_from_to("n", 1, MAX_CHOICES)?.unwrap_or(1))
}

/// `max_draft` (an extension): the most tokens drafted per trip, `0..=64`; absent leaves it
/// to the tracker.
fn parse_max_draft(fields: &Fields<'_>) -> Result<Option<usize>, ApiError> {
    fields.int_from_to("max_draft", 0, MAX_DRAFT_LIMIT)
}

/// `stream_options.include_usage`, default false.
fn parse_include_usage(fields: &Fields<'_>) -> Result<bool, ApiError> {
    match fields.get("stream_options") {
        None => Ok(false),
        Some(Value::Object(options)) => Ok(Fields(options)
            .bool("include_usage")
            .map_err(|_| {
                ApiError::invalid(
                    Some("stream_options.include_usage"),
                    "Invalid type for 'stream_options.include_usage': expected a boolean.",
                )
            })?
            .unwrap_or(false)),
        Some(v) => Err(type_error("stream_options", "an object", v)),
    }
}

/// The body of `POST /tokenize`: the required `content` and `add_special` (default false).
pub(crate) fn parse_tokenize(body: &[u8]) -> Result<(String, bool), ApiError> {
    let map = json_object(body)?;
    let fields = Fields(&map);
    let content = fields.string("content")?.ok_or_else(|| {
        ApiError::invalid(Some("content"), "Missing required parameter: 'content'.")
    })?;
    let add_special = fields.bool("add_special")?.unwrap_or(false);
    Ok((content.to_owned(), add_special))
}

/// The body of `POST /detokenize`: `tokens`, an array of ids of a vocabulary of `vocab_size`
/// (possibly empty).
pub(crate) fn parse_detokenize(body: &[u8], vocab_size: usize) -> Result<Vec<u32>, ApiError> {
    let map = json_object(body)?;
    match Fields(&map).get("tokens") {
        None => Err(ApiError::invalid(
            Some("tokens"),
            "Missing required parameter: 'tokens'.",
        )),
        Some(Value::Array(items)) if items.is_empty() => Ok(Vec::new()),
        Some(Value::Array(items)) => token_ids("tokens", items, vocab_size),
        Some(v) => Err(type_error("tokens", "an array of token ids", v)),
    }
}

/// A body that must be a JSON object.
fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(
            None,
            format!("We could not parse the JSON body of your request: {e}"),
        )
    })?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ApiError::invalid(
            None,
            format!(
                "The request body must be a JSON object, but got {} instead.",
                type_name(&other)
            ),
        )),
    }
}

fn parse_messages(fields: &Fields<'_>) -> Result<Vec<ChatTurn>, ApiError> {
    let messages = match fields.get("messages") {
        None => {
            return Err(ApiError::invalid(
                Some("messages"),
                "Missing required parameter: 'messages'.",
            ));
        }
        Some(Value::Array(messages)) => messages,
        Some(v) => return Err(type_error("messages", "an array", v)),
    };
    if messages.is_empty() {
        return Err(ApiError::invalid(
            Some("messages"),
            "Invalid 'messages': empty array. Expected an array with minimum length 1.",
        ));
    }
    let turns = messages
        .iter()
        .enumerate()
        .map(|(i, message)| parse_message(i, message))
        .collect::<Result<Vec<_>, _>>()?;
    tools::check_tool_results(&turns)?;
    Ok(turns)
}

fn parse_message(index: usize, message: &Value) -> Result<ChatTurn, ApiError> {
    let at = format!("messages[{index}]");
    let Value::Object(map) = message else {
        return Err(type_error(&at, "an object", message));
    };
    let fields = Fields(map);

    let role_param = format!("{at}.role");
    let role = match fields.get("role") {
        None => {
            return Err(ApiError::invalid(
                Some(&role_param),
                format!("Missing required parameter: '{role_param}'."),
            ));
        }
        Some(Value::String(role)) => role.as_str(),
        Some(v) => return Err(type_error(&role_param, "a string", v)),
    };
    let role = match role {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        "tool" => "tool",
        other => {
            return Err(ApiError::invalid(
                Some(&role_param),
                format!(
                    "Invalid value: '{other}'. Supported values are: 'system', 'developer', \
                     'user', 'assistant' and 'tool'."
                ),
            ));
        }
    };
    let tool_calls = tools::message_tool_calls(&at, role, &fields)?;
    let tool_call_id = tools::message_tool_call_id(&at, role, &fields)?;

    let content_param = format!("{at}.content");
    let content = match fields.get("content") {
        // An assistant message that only calls tools has no text.
        None if !tool_calls.is_empty() => String::new(),
        None => {
            return Err(ApiError::invalid(
                Some(&content_param),
                format!("Missing required parameter: '{content_param}'."),
            ));
        }
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(j, part)| text_part(&format!("{content_param}[{j}]"), part))
            .collect::<Result<Vec<_>, _>>()?
            .join("\n"),
        Some(v) => return Err(type_error(&content_param, "a string or an array", v)),
    };

    Ok(ChatTurn {
        role: role.to_owned(),
        content,
        tool_calls,
        tool_call_id,
    })
}

/// The text of one content part, which must be `{"type": "text", "text": "..."}`.
fn text_part<'a>(at: &str, part: &'a Value) -> Result<&'a str, ApiError> {
    let Value::Object(map) = part else {
        return Err(type_error(at, "an object", part));
    };
    let fields = Fields(map);
    let type_param = format!("{at}.type");
    match fields.get("type") {
        Some(Value::String(kind)) if kind == "text" => {}
        Some(Value::String(kind)) => {
            return Err(ApiError::invalid(
                Some(&type_param),
                format!("Invalid value: '{kind}'. Only 'text' content parts are supported."),
            ));
        }
        Some(v) => return Err(type_error(&type_param, "a string", v)),
        None => {
            return Err(ApiError::invalid(
                Some(&type_param),
                format!("Missing required parameter: '{type_param}'."),
            ));
        }
    }
    let text_param = format!("{at}.text");
    match fields.get("text") {
        Some(Value::String(text)) => Ok(text),
        Some(v) => Err(type_error(&text_param, "a string", v)),
        None => Err(ApiError::invalid(
            Some(&text_param),
            format!("Missing required parameter: '{text_param}'."),
        )),
    }
}

/// `prompt`: a string or an array of token ids, alone or as the one item of an array.
fn parse_prompt(fields: &Fields<'_>, vocab_size: usize) -> Result<Vec<PromptInput>, ApiError> {
    let invalid = |message: String| ApiError::invalid(Some("prompt"), message);
    let items = match fields.get("prompt") {
        None => return Err(invalid("Missing required parameter: 'prompt'.".to_owned())),
        Some(Value::String(prompt)) => return Ok(vec![PromptInput::Text(prompt.clone())]),
        Some(Value::Array(items)) => items,
        Some(v) => return Err(type_error("prompt", "a string or an array", v)),
    };
    let prompts = match items.first() {
        None => {
            return Err(invalid(
                "Invalid 'prompt': empty array. Expected a string, token ids, or an array of \
                 them."
                    .to_owned(),
            ));
        }
        Some(Value::String(_) | Value::Array(_)) => items
            .iter()
            .map(|item| match item {
                Value::String(prompt) => Ok(PromptInput::Text(prompt.clone())),
                Value::Array(ids) => token_ids("prompt", ids, vocab_size).map(PromptInput::Tokens),
                other => Err(type_error(
                    "prompt",
                    "strings or arrays of token ids",
                    other,
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => vec![PromptInput::Tokens(token_ids("prompt", items, vocab_size)?)],
    };
    if prompts.len() > MAX_CHOICES {
        return Err(invalid(format!(
            "Invalid 'prompt': {} prompts given; at most {MAX_CHOICES} per request.",
            prompts.len()
        )));
    }
    Ok(prompts)
}

/// A non-empty list of token ids of a vocabulary of `vocab_size`, for `param`.
fn token_ids(param: &str, items: &[Value], vocab_size: usize) -> Result<Vec<u32>, ApiError> {
    if items.is_empty() {
        return Err(ApiError::invalid(
            Some(param),
            format!("Invalid '{param}': no token ids."),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(index, item)| {
            item.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .filter(|&id| (id as usize) < vocab_size)
                .ok_or_else(|| {
                    ApiError::invalid(
                        Some(param),
                        format!(
                            "Invalid '{param}': item {index} is {item}, not a token id of this \
                             model (an integer with 0 <= id < {vocab_size})."
                        ),
                    )
                })
        })
        .collect()
}

/// `logit_bias`: an object from token ids (as strings) in the vocabulary to biases in
/// `-100..=100`, which may not ban every token.
fn parse_logit_bias(fields: &Fields<'_>, vocab_size: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let invalid = |message: String| ApiError::invalid(Some("logit_bias"), message);
    let map = match fields.get("logit_bias") {
        None => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(v) => return Err(type_error("logit_bias", "an object", v)),
    };
    let mut biases = Vec::with_capacity(map.len());
    for (key, value) in map {
        let id = key
            .parse::<u32>()
            .ok()
            .filter(|&id| (id as usize) < vocab_size)
            .ok_or_else(|| {
                invalid(format!(
                    "Invalid 'logit_bias': '{key}' is not a token id of this model \
                     (0 <= id < {vocab_size})."
                ))
            })?;
        let bias = value
            .as_f64()
            .filter(|bias| (-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(bias))
            .ok_or_else(|| {
                invalid(format!(
                    "Invalid 'logit_bias': the bias of token {key} is {value}, not a number \
                     between -100 and 100."
                ))
            })?;
        biases.push((id, bias as f32));
    }
    let banned = biases
        .iter()
        .filter(|&&(_, bias)| f64::from(bias) <= -MAX_LOGIT_BIAS)
        .count();
    if vocab_size > 0 && banned == vocab_size {
        return Err(invalid(
            "Invalid 'logit_bias': it bans every token of the vocabulary.".to_owned(),
        ));
    }
    Ok(biases)
}

/// Chat's `logprobs` (boolean) and `top_logprobs` (`0..=20`, only with `logprobs: true`):
/// how many of the most likely tokens to report with each token's log-probability.
/// Completions' legacy `logprobs` (an integer) is refused.
fn parse_logprobs(endpoint: Endpoint, fields: &Fields<'_>) -> Result<Option<usize>, ApiError> {
    if endpoint == Endpoint::Text {
        return match fields.get("logprobs") {
            None | Some(Value::Bool(false)) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(top) if top <= MAX_TOP_LOGPROBS as u64 => Ok(Some(top as usize)),
                _ if v.is_number() => Err(ApiError::invalid(
                    Some("logprobs"),
                    format!(
                        "Invalid 'logprobs': {v} is not an integer between 0 and \
                         {MAX_TOP_LOGPROBS}."
                    ),
                )),
                _ => Err(type_error("logprobs", "an integer", v)),
            },
        };
    }
    let wanted = fields.bool("logprobs")?.unwrap_or(false);
    let Some(top) = fields.get("top_logprobs") else {
        return Ok(wanted.then_some(0));
    };
    let top = top
        .as_u64()
        .and_then(|top| usize::try_from(top).ok())
        .filter(|&top| top <= MAX_TOP_LOGPROBS)
        .ok_or_else(|| {
            ApiError::invalid(
                Some("top_logprobs"),
                format!(
                    "Invalid 'top_logprobs': {top} is not an integer between 0 and \
                     {MAX_TOP_LOGPROBS}."
                ),
            )
        })?;
    if !wanted {
        return Err(ApiError::invalid(
            Some("top_logprobs"),
            "'top_logprobs' requires 'logprobs' to be true.",
        ));
    }
    Ok(Some(top))
}

fn parse_stop(fields: &Fields<'_>) -> Result<Vec<String>, ApiError> {
    let stop: Vec<String> = match fields.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP_SEQUENCES {
                return Err(ApiError::invalid(
                    Some("stop"),
                    format!(
                        "Invalid 'stop': array too long. Expected at most {MAX_STOP_SEQUENCES} \
                         sequences, but got {}.",
                        items.len()
                    ),
                ));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(type_error(&format!("stop[{i}]"), "a string", other)),
                })
                .collect::<Result<_, _>>()?
        }
        Some(v) => return Err(type_error("stop", "a string or an array of strings", v)),
    };
    // An empty stop sequence would match everywhere; treat it as not given.
    Ok(stop.into_iter().filter(|s| !s.is_empty()).collect())
}

/// Typed access to a JSON object's fields, where `null` means absent.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        self.get(name)
            .map(|v| v.as_str().ok_or_else(|| type_error(name, "a string", v)))
            .transpose()
    }

    /// A string field of the object at `at`, named `at.name` in errors.
    fn string_at(&self, at: &str, name: &str) -> Result<Option<&'a str>, ApiError> {
        self.get(name)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| type_error(&format!("{at}.{name}"), "a string", v))
            })
            .transpose()
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.get(name)
            .map(|v| v.as_bool().ok_or_else(|| type_error(name, "a boolean", v)))
            .transpose()
    }

    fn number(&self, name: &str) -> Result<Option<f64>, ApiError> {
        self.get(name)
            .map(|v| v.as_f64().ok_or_else(|| type_error(name, "a number", v)))
            .transpose()
    }

    /// A number in `low..=high`.
    fn number_between(&self, name: &str, low: f64, high: f64) -> Result<Option<f64>, ApiError> {
        match self.number(name)? {
            Some(n) if !(low..=high).contains(&n) => Err(ApiError::invalid(
                Some(name),
                format!("Invalid '{name}': {n} is not between {low} and {high}."),
            )),
            n => Ok(n),
        }
    }

    /// `seed`: any integer (a negative seed keeps its bits).
    fn seed(&self) -> Result<Option<u64>, ApiError> {
        self.get("seed")
            .map(|v| {
                v.as_u64()
                    .or_else(|| v.as_i64().map(|s| s as u64))
                    .ok_or_else(|| type_error("seed", "an integer", v))
            })
            .transpose()
    }

    /// `top_p`: a number with `0 < top_p <= 1`.
    fn top_p(&self) -> Result<Option<f32>, ApiError> {
        match self.number("top_p")? {
            Some(p) if !(p > 0.0 && p <= 1.0) => Err(ApiError::invalid(
                Some("top_p"),
                format!("Invalid 'top_p': {p} is not greater than 0 and at most 1."),
            )),
            p => Ok(p.map(|p| p as f32)),
        }
    }

    /// A penalty in `-2..=2`, default 0.
    fn penalty(&self, name: &str) -> Result<f32, ApiError> {
        let penalty = self.number_between(name, -MAX_PENALTY, MAX_PENALTY)?;
        Ok(penalty.unwrap_or(0.0) as f32)
    }

    /// An integer from `low` to `high`.
    fn int_from_to(&self, name: &str, low: usize, high: usize) -> Result<Option<usize>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        if !v.is_number() {
            return Err(type_error(name, "an integer", v));
        }
        match v.as_u64().and_then(|k| usize::try_from(k).ok()) {
            Some(k) if (low..=high).contains(&k) => Ok(Some(k)),
            _ => Err(ApiError::invalid(
                Some(name),
                format!("Invalid '{name}': {v} is not an integer from {low} to {high}."),
            )),
        }
    }

    /// An integer of at least 1.
    fn positive_int(&self, name: &str) -> Result<Option<usize>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        if !(v.is_u64() || v.is_i64()) {
            return Err(type_error(name, "an integer", v));
        }
        match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) if n >= 1 => Ok(Some(n)),
            _ => Err(ApiError::invalid(
                Some(name),
                format!("Invalid '{name}': {v} is not a positive integer (minimum 1)."),
            )),
        }
    }
}

fn type_error(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        Some(param),
        format!(
            "Invalid type for '{param}': expected {expected}, but got {} instead.",
            type_name(got)
        ),
    )
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a decimal",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// The vocabulary size of the tests' model.
    const VOCAB: usize = 100;

    fn chat(body: Value) -> Result<ParsedRequest, ApiError> {
        parse(Endpoint::Chat, body.to_string().as_bytes(), "m", VOCAB)
    }

    fn text(body: Value) -> Result<ParsedRequest, ApiError> {
        parse(Endpoint::Text, body.to_string().as_bytes(), "m", VOCAB)
    }

    fn param_of(result: Result<ParsedRequest, ApiError>) -> Option<String> {
        match result {
            Err(e) => e.body().error.param,
            Ok(parsed) => panic!("expected an error, parsed {parsed:?}"),
        }
    }

    #[test]
    fn chat_defaults_and_roles() {
        let parsed = chat(json!({
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok", "name": "x"}
            ],
            "tools": null,
            "frequency_penalty": 0.5
        }))
        .unwrap();
        assert_eq!(
            parsed.prompts,
            [PromptInput::Chat(vec![
                ChatTurn::new("system", "be brief"),
                ChatTurn::new("user", "a\nb"),
                ChatTurn::new("assistant", "ok"),
            ])]
        );
        assert_eq!(parsed.max_tokens, None);
        let sampling = SamplingConfig {
            temperature: 1.0,
            frequency_penalty: 0.5,
            seed: parsed.sampling.seed,
            ..SamplingConfig::greedy()
        };
        assert_eq!(parsed.sampling, sampling);
        assert_eq!(parsed.logprobs, None);
        assert!(parsed.stop.is_empty());
        assert!(!parsed.stream);
        assert!(!parsed.include_usage);
    }

    #[test]
    fn chat_sampling_fields() {
        let parsed = chat(json!({
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "max_completion_tokens": 9,
            "temperature": 0,
            "top_p": 0.5,
            "seed": -1,
            "stop": ["x", "", "y"],
            "n": 1,
            "stream": true,
            "stream_options": {"include_usage": true},
            "user": "u",
            "top_k": 40,
            "min_p": 0.05,
            "presence_penalty": -2,
            "frequency_penalty": 1.5,
            "logit_bias": {"7": -100, "0": 2.5, "99": 100}
        }))
        .unwrap();
        assert_eq!(parsed.max_tokens, Some(9));
        let mut sampling = parsed.sampling.clone();
        sampling.logit_bias.sort_by_key(|&(id, _)| id);
        let expected = SamplingConfig {
            temperature: 0.0,
            top_p: Some(0.5),
            top_k: Some(40),
            min_p: Some(0.05),
            presence_penalty: -2.0,
            frequency_penalty: 1.5,
            logit_bias: vec![(0, 2.5), (7, -100.0), (99, 100.0)],
            seed: u64::MAX,
        };
        assert_eq!(sampling, expected);
        assert_eq!(parsed.stop, vec!["x".to_owned(), "y".to_owned()]);
        assert!(parsed.stream);
        assert!(parsed.include_usage);
    }

    #[test]
    fn max_draft_sets_the_draft_length_of_one_request() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let draft = |body: Value| chat(body).unwrap().max_draft;
        assert_eq!(draft(json!({"model": "m", "messages": user})), None);
        assert_eq!(
            draft(json!({"model": "m", "messages": user, "max_draft": null})),
            None
        );
        for k in [0, 3, MAX_DRAFT_LIMIT] {
            assert_eq!(
                draft(json!({"model": "m", "messages": user, "max_draft": k})),
                Some(k)
            );
        }
        let prompt = json!({"model": "m", "prompt": "hi", "max_draft": 0});
        assert_eq!(text(prompt).unwrap().max_draft, Some(0));
    }

    #[test]
    fn null_fields_count_as_absent() {
        let parsed = chat(json!({
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": null, "temperature": null, "top_p": null, "seed": null,
            "stop": null, "n": null, "stream": null, "stream_options": null
        }))
        .unwrap();
        assert_eq!(parsed.max_tokens, None);
        assert_eq!(parsed.sampling.temperature, 1.0);
        assert_eq!(parsed.n, 1);
    }

    #[test]
    fn n_takes_one_to_eight_choices() {
        for n in 1..=MAX_CHOICES {
            let body =
                json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": n});
            assert_eq!(chat(body).unwrap().n, n);
        }
    }

    #[test]
    fn requests_without_a_seed_get_different_random_seeds() {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let seeds: std::collections::HashSet<u64> = (0..8)
            .map(|_| chat(body.clone()).unwrap().sampling.seed)
            .collect();
        assert_eq!(seeds.len(), 8);
    }

    #[test]
    fn completion_prompt_forms() {
        let one = text(json!({"model": "m", "prompt": "abc", "stop": "\n"})).unwrap();
        assert_eq!(one.prompts, [PromptInput::Text("abc".into())]);
        assert_eq!(one.stop, vec!["\n".to_owned()]);
        let array = text(json!({"model": "m", "prompt": ["abc"], "echo": false})).unwrap();
        assert_eq!(array.prompts, [PromptInput::Text("abc".into())]);
        let ids = text(json!({"model": "m", "prompt": [0, 5, 99]})).unwrap();
        assert_eq!(ids.prompts, [PromptInput::Tokens(vec![0, 5, 99])]);
        let nested = text(json!({"model": "m", "prompt": [[7, 8]]})).unwrap();
        assert_eq!(nested.prompts, [PromptInput::Tokens(vec![7, 8])]);
        let several = text(json!({"model": "m", "prompt": ["a", [1, 2], "b"], "n": 2})).unwrap();
        assert_eq!(
            several.prompts,
            [
                PromptInput::Text("a".into()),
                PromptInput::Tokens(vec![1, 2]),
                PromptInput::Text("b".into())
            ]
        );
        let too_many = json!({"model": "m", "prompt": ["a", "b", "c"], "n": 3});
        assert_eq!(param_of(text(too_many)).as_deref(), Some("n"));
        for bad in [
            json!(vec!["a"; 9]),
            json!([[1], [100]]),
            json!(["a", 1]),
            json!([]),
            json!([[]]),
            json!([1, 100]),
            json!([-1]),
            json!([1.5]),
            json!([1, "a"]),
            json!([4294967296u64]),
            json!(3),
            json!({"text": "a"}),
        ] {
            assert_eq!(
                param_of(text(json!({"model": "m", "prompt": bad}))).as_deref(),
                Some("prompt")
            );
        }
    }

    #[test]
    fn failures_name_their_field() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let cases = [
            (json!({"messages": user}), "model"),
            (json!({"model": 3, "messages": user}), "model"),
            (json!({"model": "m"}), "messages"),
            (json!({"model": "m", "messages": []}), "messages"),
            (json!({"model": "m", "messages": "hi"}), "messages"),
            (json!({"model": "m", "messages": [3]}), "messages[0]"),
            (
                json!({"model": "m", "messages": [{"role": "function", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user"}]}),
                "messages[0].content",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"model": "m", "messages": user, "max_tokens": 0}),
                "max_tokens",
            ),
            (
                json!({"model": "m", "messages": user, "max_tokens": 1.5}),
                "max_tokens",
            ),
            (
                json!({"model": "m", "messages": user, "max_completion_tokens": -2}),
                "max_completion_tokens",
            ),
            (
                json!({"model": "m", "messages": user, "temperature": 3}),
                "temperature",
            ),
            (
                json!({"model": "m", "messages": user, "temperature": "hot"}),
                "temperature",
            ),
            (json!({"model": "m", "messages": user, "top_p": 0}), "top_p"),
            (
                json!({"model": "m", "messages": user, "top_p": 1.1}),
                "top_p",
            ),
            (json!({"model": "m", "messages": user, "seed": 1.5}), "seed"),
            (
                json!({"model": "m", "messages": user, "presence_penalty": 2.5}),
                "presence_penalty",
            ),
            (
                json!({"model": "m", "messages": user, "presence_penalty": "high"}),
                "presence_penalty",
            ),
            (
                json!({"model": "m", "messages": user, "frequency_penalty": -2.01}),
                "frequency_penalty",
            ),
            (json!({"model": "m", "messages": user, "top_k": 0}), "top_k"),
            (
                json!({"model": "m", "messages": user, "max_draft": 65}),
                "max_draft",
            ),
            (
                json!({"model": "m", "messages": user, "max_draft": -1}),
                "max_draft",
            ),
            (
                json!({"model": "m", "messages": user, "max_draft": "4"}),
                "max_draft",
            ),
            (
                json!({"model": "m", "messages": user, "top_k": 2.5}),
                "top_k",
            ),
            (
                json!({"model": "m", "messages": user, "min_p": 1.5}),
                "min_p",
            ),
            (
                json!({"model": "m", "messages": user, "min_p": -0.1}),
                "min_p",
            ),
            (
                json!({"model": "m", "messages": user, "logit_bias": [1]}),
                "logit_bias",
            ),
            (
                json!({"model": "m", "messages": user, "logit_bias": {"the": 1}}),
                "logit_bias",
            ),
            (
                json!({"model": "m", "messages": user, "logit_bias": {"100": 1}}),
                "logit_bias",
            ),
            (
                json!({"model": "m", "messages": user, "logit_bias": {"-1": 1}}),
                "logit_bias",
            ),
            (
                json!({"model": "m", "messages": user, "logit_bias": {"5": 100.5}}),
                "logit_bias",
            ),
            (
                json!({"model": "m", "messages": user, "logit_bias": {"5": "ban"}}),
                "logit_bias",
            ),
            (json!({"model": "m", "messages": user, "n": 0}), "n"),
            (json!({"model": "m", "messages": user, "n": 9}), "n"),
            (json!({"model": "m", "messages": user, "n": 1.5}), "n"),
            (json!({"model": "m", "messages": user, "n": "2"}), "n"),
            (
                json!({"model": "m", "messages": user, "stop": ["a", "b", "c", "d", "e"]}),
                "stop",
            ),
            (
                json!({"model": "m", "messages": user, "stop": [1]}),
                "stop[0]",
            ),
            (
                json!({"model": "m", "messages": user, "stream": "yes"}),
                "stream",
            ),
            (
                json!({"model": "m", "messages": user, "stream_options": {"include_usage": 1}}),
                "stream_options.include_usage",
            ),
        ];
        for (body, param) in cases {
            assert_eq!(
                param_of(chat(body.clone())).as_deref(),
                Some(param),
                "body {body}"
            );
        }
        assert_eq!(
            param_of(text(json!({"model": "m", "prompt": "x", "echo": 1}))).as_deref(),
            Some("echo")
        );
        assert_eq!(
            param_of(text(json!({"model": "m"}))).as_deref(),
            Some("prompt")
        );
    }

    #[test]
    fn a_logit_bias_may_ban_all_tokens_but_one() {
        let bans = |count: usize| -> Map<String, Value> {
            (0..count).map(|id| (id.to_string(), json!(-100))).collect()
        };
        let body =
            |bias: Map<String, Value>| json!({"model": "m", "prompt": "x", "logit_bias": bias});
        let parsed = text(body(bans(VOCAB - 1))).unwrap();
        assert_eq!(parsed.sampling.logit_bias.len(), VOCAB - 1);
        let error = text(body(bans(VOCAB))).unwrap_err();
        assert_eq!(error.body().error.param.as_deref(), Some("logit_bias"));
        assert!(error.to_string().contains("every token"), "{error}");
    }

    #[test]
    fn tokenize_and_detokenize_bodies() {
        let tokenize = |body: Value| parse_tokenize(body.to_string().as_bytes());
        assert_eq!(
            tokenize(json!({"content": "a b"})).unwrap(),
            ("a b".to_owned(), false)
        );
        assert_eq!(
            tokenize(json!({"content": "", "add_special": true})).unwrap(),
            (String::new(), true)
        );
        for (body, param) in [
            (json!({}), "content"),
            (json!({"content": 3}), "content"),
            (json!({"content": "a", "add_special": "yes"}), "add_special"),
        ] {
            let error = tokenize(body.clone()).unwrap_err();
            assert_eq!(error.body().error.param.as_deref(), Some(param), "{body}");
        }

        let detokenize = |body: Value| parse_detokenize(body.to_string().as_bytes(), VOCAB);
        assert_eq!(
            detokenize(json!({"tokens": [0, 99, 5]})).unwrap(),
            [0, 99, 5]
        );
        assert!(detokenize(json!({"tokens": []})).unwrap().is_empty());
        for bad in [
            json!({}),
            json!({"tokens": "1 2"}),
            json!({"tokens": [100]}),
            json!({"tokens": [-1]}),
            json!({"tokens": [[1]]}),
        ] {
            let error = detokenize(bad.clone()).unwrap_err();
            assert_eq!(error.body().error.param.as_deref(), Some("tokens"), "{bad}");
        }
        assert!(matches!(
            parse_tokenize(b"[]"),
            Err(ApiError::InvalidRequest { param: None, .. })
        ));
    }

    #[test]
    fn logprobs_and_top_logprobs() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let request = |extra: Value| {
            let mut body = json!({"model": "m", "messages": user});
            for (field, value) in extra.as_object().unwrap() {
                body[field] = value.clone();
            }
            chat(body)
        };
        let logprobs = |extra: Value| request(extra).unwrap().logprobs;
        assert_eq!(logprobs(json!({})), None);
        assert_eq!(logprobs(json!({"logprobs": false})), None);
        assert_eq!(logprobs(json!({"logprobs": true})), Some(0));
        let top = json!({"logprobs": true, "top_logprobs": 20});
        assert_eq!(logprobs(top), Some(20));
        let null = json!({"logprobs": true, "top_logprobs": null});
        assert_eq!(logprobs(null), Some(0));
        for (extra, param) in [
            (json!({"logprobs": 1}), "logprobs"),
            (
                json!({"logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (
                json!({"logprobs": true, "top_logprobs": -1}),
                "top_logprobs",
            ),
            (
                json!({"logprobs": true, "top_logprobs": 1.5}),
                "top_logprobs",
            ),
            (json!({"top_logprobs": 2}), "top_logprobs"),
            (
                json!({"logprobs": false, "top_logprobs": 0}),
                "top_logprobs",
            ),
        ] {
            let error = param_of(request(extra.clone()));
            assert_eq!(error.as_deref(), Some(param), "{extra}");
        }
        let text_logprobs = |value: Value| {
            text(json!({"model": "m", "prompt": "x", "logprobs": value})).map(|p| p.logprobs)
        };
        assert_eq!(text_logprobs(json!(0)).unwrap(), Some(0));
        assert_eq!(text_logprobs(json!(5)).unwrap(), Some(5));
        assert_eq!(text_logprobs(json!(20)).unwrap(), Some(20));
        assert_eq!(text_logprobs(json!(false)).unwrap(), None);
        for bad in [json!(21), json!(-1), json!(1.5), json!(true), json!("2")] {
            let body = json!({"model": "m", "prompt": "x", "logprobs": bad});
            assert_eq!(param_of(text(body)).as_deref(), Some("logprobs"), "{bad}");
        }
        let echo = text(json!({"model": "m", "prompt": "x", "echo": true})).unwrap();
        assert!(echo.echo);
    }

    #[test]
    fn response_formats_are_parsed_on_both_endpoints() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let full = json!({
            "type": "json_schema",
            "json_schema": {"name": "A_b-9", "schema": schema, "strict": true, "description": "d"},
        });
        let expected = ResponseFormat::JsonSchema(JsonSchemaFormat {
            name: "A_b-9".to_owned(),
            description: Some("d".to_owned()),
            schema: schema.clone(),
            strict: true,
        });
        let minimal = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}});
        let minimal_expected = ResponseFormat::JsonSchema(JsonSchemaFormat {
            name: "x".to_owned(),
            description: None,
            schema: json!({}),
            strict: false,
        });
        let cases = [
            (None, ResponseFormat::Text),
            (Some(Value::Null), ResponseFormat::Text),
            (Some(json!({"type": "text"})), ResponseFormat::Text),
            (
                Some(json!({"type": "json_object"})),
                ResponseFormat::JsonObject,
            ),
            (Some(full), expected),
            (Some(minimal), minimal_expected),
        ];
        for (format, expected) in cases {
            let mut body = json!({"model": "m", "messages": user, "prompt": "x"});
            if let Some(format) = &format {
                body["response_format"] = format.clone();
            }
            assert_eq!(
                chat(body.clone()).unwrap().response_format,
                expected,
                "{body}"
            );
            assert_eq!(
                text(body.clone()).unwrap().response_format,
                expected,
                "{body}"
            );
        }
    }

    #[test]
    fn bad_response_formats_name_the_field_at_fault() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let schema_format =
            |json_schema: Value| json!({"type": "json_schema", "json_schema": json_schema});
        let cases = [
            (json!("json_object"), "response_format"),
            (json!([]), "response_format"),
            (json!({}), "response_format.type"),
            (json!({"type": 1}), "response_format.type"),
            (json!({"type": "xml"}), "response_format.type"),
            (
                json!({"type": "json_schema"}),
                "response_format.json_schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": "s"}),
                "response_format.json_schema",
            ),
            (
                schema_format(json!({"schema": {}})),
                "response_format.json_schema.name",
            ),
            (
                schema_format(json!({"name": 3, "schema": {}})),
                "response_format.json_schema.name",
            ),
            (
                schema_format(json!({"name": "has space", "schema": {}})),
                "response_format.json_schema.name",
            ),
            (
                schema_format(json!({"name": "", "schema": {}})),
                "response_format.json_schema.name",
            ),
            (
                schema_format(json!({"name": "n".repeat(65), "schema": {}})),
                "response_format.json_schema.name",
            ),
            (
                schema_format(json!({"name": "n"})),
                "response_format.json_schema.schema",
            ),
            (
                schema_format(json!({"name": "n", "schema": "{}"})),
                "response_format.json_schema.schema",
            ),
            (
                schema_format(json!({"name": "n", "schema": true})),
                "response_format.json_schema.schema",
            ),
            (
                schema_format(json!({"name": "n", "schema": {}, "strict": "yes"})),
                "response_format.json_schema.strict",
            ),
            (
                schema_format(json!({"name": "n", "schema": {}, "description": 1})),
                "response_format.json_schema.description",
            ),
        ];
        for (format, param) in cases {
            let body = json!({"model": "m", "messages": user, "response_format": format});
            assert_eq!(
                param_of(chat(body.clone())).as_deref(),
                Some(param),
                "{body}"
            );
        }
        let name = "n".repeat(64);
        let longest = schema_format(json!({"name": name, "schema": {}}));
        let body = json!({"model": "m", "messages": user, "response_format": longest});
        assert!(chat(body).is_ok());
    }

    #[test]
    fn body_level_failures_have_no_param() {
        for body in ["{", "[]", "\"x\"", ""] {
            let result = parse(Endpoint::Chat, body.as_bytes(), "m", VOCAB);
            assert!(
                matches!(result, Err(ApiError::InvalidRequest { param: None, .. })),
                "body {body:?}"
            );
        }
    }

    #[test]
    fn unknown_model_is_not_found() {
        let result =
            chat(json!({"model": "other", "messages": [{"role": "user", "content": "hi"}]}));
        assert!(matches!(result, Err(ApiError::ModelNotFound(ref m)) if m == "other"));
    }
}
