//! Key/value caches kept apart from the weights: one per session, one pair of tensors per
//! layer, indexed by absolute position and bounded by a byte budget shared by all sessions.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::Tensor;

use crate::error::{ModelError, Result};

/// Identifies one generation (one conversation) across every span that serves it.
pub type SessionId = uuid::Uuid;

/// The default budget of a [`KvStore`]: 256 MiB.
pub const DEFAULT_KV_BUDGET_BYTES: usize = 256 * 1024 * 1024;

/// The cached keys and values of one session in one span.
#[derive(Debug)]
pub struct SessionCache {
    /// Per layer of the span, `(keys, values)` of shape `[1, kv_heads, positions, head_dim]`.
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// How many positions (0..len) the cache holds.
    len: usize,
    /// Bytes held by the tensors.
    bytes: usize,
}

impl SessionCache {
    fn new(layer_count: usize) -> Self {
        Self {
            layers: vec![None; layer_count],
            len: 0,
            bytes: 0,
        }
    }

    /// Number of positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the cache holds no position yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The cached keys and values of a layer (index within the span), if any.
    pub fn layer(&self, index: usize) -> Option<&(Tensor, Tensor)> {
        self.layers.get(index).and_then(Option::as_ref)
    }

    /// Appends one chunk's keys and values for a layer, returning the full keys and values.
    /// Byte accounting and position checks are the store's job ([`KvStore::with_session`]).
    pub(crate) fn append(
        &mut self,
        index: usize,
        keys: Tensor,
        values: Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let slot = self
            .layers
            .get_mut(index)
            .ok_or_else(|| ModelError::InvalidSpan(format!("no cache slot for layer {index}")))?;
        let added = (keys.elem_count() + values.elem_count()) * keys.dtype().size_in_bytes();
        let joined = match slot.take() {
            None => (keys, values),
            Some((cached_keys, cached_values)) => (
                Tensor::cat(&[&cached_keys, &keys], 2)?,
                Tensor::cat(&[&cached_values, &values], 2)?,
            ),
        };
        *slot = Some(joined.clone());
        self.bytes += added;
        Ok(joined)
    }
}

/// All sessions' caches of one span, with a shared byte budget.
///
/// A forward pass checks its session out of the store, computes, and checks it back in, so
/// different sessions can run at the same time on the same weights.
#[derive(Debug)]
pub struct KvStore {
    layer_count: usize,
    bytes_per_position: usize,
    budget_bytes: usize,
    inner: Mutex<StoreState>,
}

#[derive(Debug, Default)]
struct StoreState {
    sessions: HashMap<SessionId, SessionCache>,
    /// Bytes held or reserved by all sessions, including those checked out.
    used_bytes: usize,
}

impl KvStore {
    /// A store for a span of `layer_count` layers whose caches take `bytes_per_position` bytes
    /// per position over all its layers, holding at most `budget_bytes`.
    pub fn new(layer_count: usize, bytes_per_position: usize, budget_bytes: usize) -> Self {
        Self {
            layer_count,
            bytes_per_position,
            budget_bytes,
            inner: Mutex::new(StoreState::default()),
        }
    }

    /// Bytes held by all sessions.
    pub fn used_bytes(&self) -> usize {
        self.lock().used_bytes
    }

    /// The byte budget.
    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    /// How many sessions hold cached positions.
    pub fn session_count(&self) -> usize {
        self.lock().sessions.len()
    }

    /// Bytes one cached position takes over all the span's layers.
    pub fn bytes_per_position(&self) -> usize {
        self.bytes_per_position
    }

    /// How many positions a session has cached (0 for an unknown session).
    pub fn session_len(&self, session: SessionId) -> usize {
        self.lock()
            .sessions
            .get(&session)
            .map_or(0, SessionCache::len)
    }

    /// Drops a session's cache, freeing its bytes. Unknown sessions are ignored.
    pub fn end_session(&self, session: SessionId) {
        let mut state = self.lock();
        if let Some(cache) = state.sessions.remove(&session) {
            state.used_bytes = state.used_bytes.saturating_sub(cache.bytes);
        }
    }

    /// Runs `compute` on the session's cache for a chunk of `tokens` positions starting at
    /// `position`, which must be exactly where the cache ends. The chunk's bytes are reserved
    /// against the budget first. On error the session keeps the state it had before.
    pub fn with_session<T>(
        &self,
        session: SessionId,
        position: usize,
        tokens: usize,
        compute: impl FnOnce(&mut SessionCache) -> Result<T>,
    ) -> Result<T> {
        let needed = tokens * self.bytes_per_position;
        let mut cache = {
            let mut state = self.lock();
            let cached = state.sessions.get(&session).map_or(0, SessionCache::len);
            if position != cached {
                return Err(ModelError::PositionMismatch {
                    session: session.to_string(),
                    position,
                    cached,
                    kind: if position > cached { "gap" } else { "overlap" },
                });
            }
            if state.used_bytes + needed > self.budget_bytes {
                return Err(ModelError::CacheBudget {
                    needed,
                    used: state.used_bytes,
                    budget: self.budget_bytes,
                });
            }
            state.used_bytes += needed;
            state
                .sessions
                .remove(&session)
                .unwrap_or_else(|| SessionCache::new(self.layer_count))
        };
        let before_bytes = cache.bytes;
        let snapshot: Vec<Option<(Tensor, Tensor)>> = cache.layers.clone();
        let outcome = compute(&mut cache);
        let mut state = self.lock();
        state.used_bytes = state.used_bytes.saturating_sub(needed);
        match outcome {
            Ok(value) => {
                state.used_bytes += cache.bytes - before_bytes;
                cache.len = position + tokens;
                state.sessions.insert(session, cache);
                Ok(value)
            }
            Err(error) => {
                cache.layers = snapshot;
                cache.bytes = before_bytes;
                if cache.len > 0 {
                    state.sessions.insert(session, cache);
                }
                Err(error)
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StoreState> {
        // A panic inside `compute` never holds the lock, so a poisoned mutex still has
        // consistent contents.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn chunk(tokens: usize) -> (Tensor, Tensor) {
        let keys = Tensor::zeros((1, 2, tokens, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        (keys.clone(), keys)
    }

    fn append(store: &KvStore, session: SessionId, position: usize, tokens: usize) -> Result<()> {
        store.with_session(session, position, tokens, |cache| {
            let (keys, values) = chunk(tokens);
            cache.append(0, keys, values)?;
            Ok(())
        })
    }

    #[test]
    fn appends_and_rejects_gaps_and_overlaps() {
        let store = KvStore::new(1, 2 * 2 * 4 * 4, 1 << 20);
        let session = SessionId::new_v4();
        append(&store, session, 0, 3).unwrap();
        append(&store, session, 3, 1).unwrap();
        assert_eq!(store.session_len(session), 4);
        assert_eq!(store.used_bytes(), 4 * 64);
        let gap = append(&store, session, 6, 1).unwrap_err();
        assert!(
            matches!(gap, ModelError::PositionMismatch { kind: "gap", .. }),
            "{gap}"
        );
        let overlap = append(&store, session, 2, 1).unwrap_err();
        assert!(
            matches!(
                overlap,
                ModelError::PositionMismatch {
                    kind: "overlap",
                    ..
                }
            ),
            "{overlap}"
        );
        assert_eq!(store.session_len(session), 4);
        store.end_session(session);
        assert_eq!(store.session_len(session), 0);
        assert_eq!(store.used_bytes(), 0);
    }

    #[test]
    fn budget_is_enforced_across_sessions() {
        let store = KvStore::new(1, 64, 64 * 5);
        let first = SessionId::new_v4();
        let second = SessionId::new_v4();
        append(&store, first, 0, 4).unwrap();
        let error = append(&store, second, 0, 2).unwrap_err();
        assert!(matches!(error, ModelError::CacheBudget { .. }), "{error}");
        append(&store, second, 0, 1).unwrap();
        store.end_session(first);
        append(&store, second, 1, 2).unwrap();
        assert_eq!(store.used_bytes(), 3 * 64);
    }

    #[test]
    fn failed_compute_leaves_the_session_unchanged() {
        let store = KvStore::new(1, 64, 1 << 20);
        let session = SessionId::new_v4();
        append(&store, session, 0, 2).unwrap();
        let result: Result<()> = store.with_session(session, 2, 1, |cache| {
            let (keys, values) = chunk(1);
            cache.append(0, keys, values)?;
            Err(ModelError::InvalidSpan("boom".into()))
        });
        assert!(result.is_err());
        assert_eq!(store.session_len(session), 2);
        assert_eq!(store.used_bytes(), 2 * 64);
        append(&store, session, 2, 1).unwrap();
    }
}
