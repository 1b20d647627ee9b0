//! API keys and per-key quotas in front of the API's routes (`--api-keys`).
//!
//! [`require_api_keys`] puts [`ApiKeyGuard`] before a router's routes. A request needs
//! `Authorization: Bearer <key>` with a key of the guard's [`KeyBook`] (else 401), and room in
//! that key's window (else 429 with `Retry-After`). A completion request reserves its
//! `max_tokens` (or `max_completion_tokens`) × `n` × prompts up front, so that one which
//! would clearly pass the key's tokens-per-minute limit is refused before it runs; when the
//! answer is made in this process, its usage (prompt and completion tokens) then replaces the
//! reservation. A request the router passes to another process (a member's tracker) keeps its
//! reservation as its charge.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use meshnet_apikeys::{Clock, KeyBook, LimitKind, Ticket, WindowVerdict};
use meshnet_metrics::Metrics;
use serde_json::Value;

use crate::error::ApiError;
use crate::request::MAX_BODY_BYTES;

/// The keys a member's API accepts, the clock their windows run on, and where usage is counted.
pub struct ApiKeyGuard {
    book: KeyBook,
    clock: Arc<dyn Clock>,
    metrics: Metrics,
}

impl std::fmt::Debug for ApiKeyGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeyGuard")
            .field("keys", &self.book.entries().len())
            .finish_non_exhaustive()
    }
}

impl ApiKeyGuard {
    /// A guard over `book`'s keys, timed by `clock`, counting into `metrics`.
    pub fn new(book: KeyBook, clock: Arc<dyn Clock>, metrics: Metrics) -> Self {
        Self {
            book,
            clock,
            metrics,
        }
    }

    /// The keys.
    pub fn book(&self) -> &KeyBook {
        &self.book
    }
}

/// `router` with every matched route behind `guard` (unknown paths still answer 404).
pub fn require_api_keys<S>(router: Router<S>, guard: Arc<ApiKeyGuard>) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    router.route_layer(axum::middleware::from_fn_with_state(guard, check))
}

/// What the `Authorization` header holds.
enum Presented {
    Missing,
    Malformed,
    Bearer(String),
}

fn presented(headers: &HeaderMap) -> Presented {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Presented::Missing;
    };
    let Ok(value) = value.to_str() else {
        return Presented::Malformed;
    };
    let mut parts = value.trim().splitn(2, ' ');
    match (parts.next(), parts.next()) {
        (Some(scheme), Some(token)) if scheme.eq_ignore_ascii_case("bearer") => {
            Presented::Bearer(token.trim().to_owned())
        }
        _ => Presented::Malformed,
    }
}

/// The middleware: 401, 429, a 400 for a reservation over the key's whole limit, or the
/// request passed on with its [`Charge`].
async fn check(State(guard): State<Arc<ApiKeyGuard>>, request: Request, next: Next) -> Response {
    let key = match presented(request.headers()) {
        Presented::Missing => None,
        Presented::Malformed => Some(None),
        Presented::Bearer(token) => Some(guard.book.find(&token)),
    };
    let key = match key {
        Some(Some(key)) => key,
        None => {
            guard.metrics.count_api_unauthorized("missing");
            return ApiError::Unauthorized(
                "You didn't provide an API key. Send it in the Authorization header: \
                 `Authorization: Bearer YOUR_KEY`."
                    .to_owned(),
            )
            .into_response();
        }
        Some(None) => {
            guard.metrics.count_api_unauthorized("invalid");
            return ApiError::Unauthorized(
                "Incorrect API key provided. Send a key this member accepts in the \
                 Authorization header: `Authorization: Bearer YOUR_KEY`."
                    .to_owned(),
            )
            .into_response();
        }
    };
    let (mut request, reserve) = match reservation(request).await {
        Ok(read) => read,
        Err(error) => return error.into_response(),
    };
    let id = guard.book.id(key).to_owned();
    match guard.book.admit(key, reserve, guard.clock.now()) {
        Ok(ticket) => {
            guard.metrics.count_api_key_request(&id);
            let charge = Charge::new(Arc::clone(&guard), id, ticket);
            request.extensions_mut().insert(charge);
            next.run(request).await
        }
        Err(refusal) => refuse(&guard, &id, reserve, refusal).into_response(),
    }
}

/// The answer to a request its key's window refused.
fn refuse(guard: &ApiKeyGuard, id: &str, reserve: u64, refusal: WindowVerdict) -> ApiError {
    match refusal {
        WindowVerdict::Limited {
            by,
            retry_after_seconds,
            limit,
            used,
        } => {
            guard.metrics.count_api_key_rate_limited(id, by.as_str());
            let (what, requested) = match by {
                LimitKind::Requests => ("requests per minute", 1),
                LimitKind::Tokens => ("tokens per minute", reserve.max(1)),
            };
            ApiError::RateLimited {
                message: format!(
                    "Rate limit reached for API key {id} on {what} ({}): limit {limit}, used \
                     {used}, requested {requested}. Please try again in {retry_after_seconds}s.",
                    by.as_str()
                ),
                retry_after_seconds,
            }
        }
        WindowVerdict::TooLarge { reserved, tpm } => ApiError::invalid(
            Some("max_tokens"),
            format!(
                "This request reserves {reserved} tokens (max_tokens × n × prompts), more than \
                 API key {id}'s limit of {tpm} tokens per minute: it could never run. Ask for \
                 fewer tokens."
            ),
        ),
        WindowVerdict::Admitted => ApiError::Engine(crate::EngineError::Internal(
            "an admitted request was refused".to_owned(),
        )),
    }
}

/// Reads a completion request's body to find its token reservation, and gives the request
/// back whole. Other requests reserve nothing and are not read.
async fn reservation(request: Request) -> Result<(Request, u64), ApiError> {
    let path = request.uri().path();
    let chat = path.ends_with("/chat/completions");
    let completing = request.method() == Method::POST && (chat || path.ends_with("/completions"));
    if !completing {
        return Ok((request, 0));
    }
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|_| ApiError::PayloadTooLarge {
            limit: MAX_BODY_BYTES,
        })?;
    let reserve = reserved_tokens(&bytes, chat);
    Ok((Request::from_parts(parts, Body::from(bytes)), reserve))
}

/// `max_tokens` (for chat `max_completion_tokens` first) × `n` × the prompts of a
/// completion request's body; 0 when it names no maximum (the request itself is validated
/// later, by the router).
fn reserved_tokens(body: &[u8], chat: bool) -> u64 {
    let Ok(Value::Object(fields)) = serde_json::from_slice::<Value>(body) else {
        return 0;
    };
    let field = |name: &str| fields.get(name).and_then(Value::as_u64);
    let max_tokens = if chat {
        field("max_completion_tokens").or_else(|| field("max_tokens"))
    } else {
        field("max_tokens")
    };
    let n = field("n").unwrap_or(1).max(1);
    let prompts = match fields.get("prompt") {
        Some(Value::Array(items)) if items.first().is_some_and(|item| !item.is_number()) => {
            items.len() as u64
        }
        _ => 1,
    };
    max_tokens
        .unwrap_or(0)
        .saturating_mul(n)
        .saturating_mul(prompts)
}

/// An admitted request's claim on its key's window, carried in the request's extensions to
/// the handler. When the last clone goes, the key is charged the usage reported (its tokens
/// counted), or, with none reported, keeps the reservation.
#[derive(Clone)]
pub(crate) struct Charge(Arc<ChargeInner>);

struct ChargeInner {
    guard: Arc<ApiKeyGuard>,
    id: String,
    ticket: Ticket,
    usage: Mutex<Option<(usize, usize)>>,
}

impl Charge {
    fn new(guard: Arc<ApiKeyGuard>, id: String, ticket: Ticket) -> Self {
        Self(Arc::new(ChargeInner {
            guard,
            id,
            ticket,
            usage: Mutex::new(None),
        }))
    }

    /// Records the request's usage: its prompt and completion tokens.
    pub(crate) fn report(&self, prompt_tokens: usize, completion_tokens: usize) {
        let mut usage = self
            .0
            .usage
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *usage = Some((prompt_tokens, completion_tokens));
    }
}

impl Drop for ChargeInner {
    fn drop(&mut self) {
        let usage = *self
            .usage
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some((prompt, completion)) = usage else {
            return;
        };
        let (prompt, completion) = (prompt as u64, completion as u64);
        let now = self.guard.clock.now();
        self.guard
            .book
            .settle(self.ticket, prompt.saturating_add(completion), now);
        self.guard
            .metrics
            .count_api_key_tokens(&self.id, prompt, completion);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn reservations_multiply_max_tokens_by_choices_and_prompts() {
        let cases: [(&str, bool, u64); 8] = [
            (r#"{"max_tokens": 16}"#, true, 16),
            (
                r#"{"max_tokens": 16, "max_completion_tokens": 4, "n": 3}"#,
                true,
                12,
            ),
            (
                r#"{"max_tokens": 16, "max_completion_tokens": 4}"#,
                false,
                16,
            ),
            (
                r#"{"max_tokens": 10, "prompt": ["a", "b"], "n": 2}"#,
                false,
                40,
            ),
            (r#"{"max_tokens": 10, "prompt": [1, 2, 3]}"#, false, 10),
            (r#"{"max_tokens": 10, "prompt": [[1], [2]]}"#, false, 20),
            (r#"{"messages": []}"#, true, 0),
            ("not json", true, 0),
        ];
        for (body, chat, reserved) in cases {
            assert_eq!(reserved_tokens(body.as_bytes(), chat), reserved, "{body}");
        }
    }

    #[test]
    fn only_a_bearer_token_is_presented() {
        let headers = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, value.parse().unwrap());
            headers
        };
        assert!(matches!(presented(&HeaderMap::new()), Presented::Missing));
        assert!(matches!(
            presented(&headers("Basic abc")),
            Presented::Malformed
        ));
        assert!(matches!(
            presented(&headers("Bearer")),
            Presented::Malformed
        ));
        assert!(
            matches!(presented(&headers("bearer  sk-1 ")), Presented::Bearer(token) if token == "sk-1")
        );
    }
}
