//! Key/value caches kept apart from the weights: one per session, one pair of growing buffers
//! of IEEE half floats per layer (position after position), indexed by absolute position and
//! bounded by a byte budget shared by all sessions.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Instant;

use candle_core::{Device, Tensor};
use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::error::{ModelError, Result};

/// Identifies one generation (one conversation) across every span that serves it.
pub type SessionId = uuid::Uuid;

/// The default budget of a [`KvStore`]: 256 MiB.
pub const DEFAULT_KV_BUDGET_BYTES: usize = 256 * 1024 * 1024;

/// Bytes one cached key or value element takes: keys and values are kept as IEEE half floats
/// (rounded to nearest, ties to even, when a chunk is appended; beyond ±65504 saturated),
/// half what f32 would take.
pub const CACHED_VALUE_BYTES: usize = 2;

/// One layer's cached keys and values, position after position: each is `[positions, width]`
/// row-major half floats, `width` being the key/value heads times the head size. Appending a
/// chunk only extends the buffers (no copy of what is cached, beyond a buffer's occasional
/// growth). A buffer grows by doubling, so it may reserve up to twice what its positions
/// take; the store's budget counts positions.
#[derive(Debug, Clone, Default)]
pub struct LayerCache {
    keys: Vec<f16>,
    values: Vec<f16>,
}

impl LayerCache {
    /// The cached keys, `[positions, width]` row-major.
    pub fn keys(&self) -> &[f16] {
        &self.keys
    }

    /// The cached values, `[positions, width]` row-major.
    pub fn values(&self) -> &[f16] {
        &self.values
    }
}

/// `rows` rounded to half floats and added at the end of `cached`; values beyond the half
/// floats' range are kept as the largest one of their sign, not as an infinity that would turn
/// every later attention over them into NaN.
fn extend_rounded(cached: &mut Vec<f16>, rows: &[f32]) {
    let largest = f16::MAX.to_f32();
    cached.extend(
        rows.iter()
            .map(|&value| f16::from_f32(value.clamp(-largest, largest))),
    );
}

/// The cached keys and values of one session in one span.
#[derive(Debug)]
pub struct SessionCache {
    /// Per layer of the span.
    layers: Vec<LayerCache>,
    /// How many positions (0..len) the cache holds.
    len: usize,
    /// Bytes held by the cached values.
    bytes: usize,
    /// When a chunk last finished on this session.
    last_used: Instant,
}

impl SessionCache {
    fn new(layer_count: usize) -> Self {
        Self {
            layers: vec![LayerCache::default(); layer_count],
            len: 0,
            bytes: 0,
            last_used: Instant::now(),
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

    /// The cached keys and values of a layer (index within the span).
    pub fn layer(&self, index: usize) -> Option<&LayerCache> {
        self.layers.get(index)
    }

    /// Appends one chunk's keys and values for a layer (`[tokens, width]` row-major each,
    /// rounded to half floats), returning everything the layer now holds. Byte accounting and
    /// position checks are the store's job ([`KvStore::with_session`]).
    pub(crate) fn append_rows(
        &mut self,
        index: usize,
        keys: &[f32],
        values: &[f32],
    ) -> Result<&LayerCache> {
        if keys.len() != values.len() {
            return Err(ModelError::InvalidSpan(format!(
                "{} keys and {} values for one chunk",
                keys.len(),
                values.len()
            )));
        }
        let slot = self
            .layers
            .get_mut(index)
            .ok_or_else(|| ModelError::InvalidSpan(format!("no cache slot for layer {index}")))?;
        extend_rounded(&mut slot.keys, keys);
        extend_rounded(&mut slot.values, values);
        self.bytes += 2 * keys.len() * CACHED_VALUE_BYTES;
        Ok(slot)
    }

    /// Appends one chunk's keys and values for a layer as tensors `[1, heads, tokens,
    /// head_dim]`, returning the layer's full keys and values in the same layout (f32 widened
    /// from the cache's half floats).
    pub(crate) fn append(
        &mut self,
        index: usize,
        keys: Tensor,
        values: Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (_, heads, _, head_dim) = keys.dims4()?;
        let rows = |tensor: &Tensor| -> Result<Vec<f32>> {
            Ok(tensor
                .transpose(1, 2)?
                .flatten_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_vec1::<f32>()?)
        };
        let (keys, values) = (rows(&keys)?, rows(&values)?);
        let layer = self.append_rows(index, &keys, &values)?;
        let positions = layer.keys.len() / (heads * head_dim);
        let heads_first = |rows: &[f16]| -> Result<Tensor> {
            Ok(Tensor::from_vec(
                rows.to_f32_vec(),
                (1, positions, heads, head_dim),
                &Device::Cpu,
            )?
            .transpose(1, 2)?
            .contiguous()?)
        };
        Ok((heads_first(&layer.keys)?, heads_first(&layer.values)?))
    }

    /// A new cache holding this one's first `len` positions (at most [`Self::len`]).
    fn prefix(&self, len: usize) -> SessionCache {
        let len = len.min(self.len);
        let layers: Vec<LayerCache> = self
            .layers
            .iter()
            .map(|layer| {
                let width = layer.keys.len().checked_div(self.len).unwrap_or(0);
                LayerCache {
                    keys: layer.keys[..len * width].to_vec(),
                    values: layer.values[..len * width].to_vec(),
                }
            })
            .collect();
        let floats: usize = layers.iter().map(|l| l.keys.len() + l.values.len()).sum();
        SessionCache {
            layers,
            len,
            bytes: floats * CACHED_VALUE_BYTES,
            last_used: Instant::now(),
        }
    }

    /// Cuts every layer back to its first `lengths[i]` values (a failed chunk's rollback).
    fn truncate(&mut self, lengths: &[usize]) {
        for (layer, &length) in self.layers.iter_mut().zip(lengths) {
            layer.keys.truncate(length);
            layer.values.truncate(length);
        }
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
    /// Sessions taken out of `sessions` while a chunk computes on them.
    computing: HashSet<SessionId>,
    /// Sessions ended while computing: dropped instead of put back when the chunk finishes.
    ended_while_computing: HashSet<SessionId>,
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

    /// How many sessions hold cached positions or are computing a chunk.
    pub fn session_count(&self) -> usize {
        let state = self.lock();
        state.sessions.len() + state.computing.len()
    }

    /// Whether the session holds cached positions or is computing a chunk here.
    pub fn has_session(&self, session: SessionId) -> bool {
        let state = self.lock();
        state.sessions.contains_key(&session) || state.computing.contains(&session)
    }

    /// Drops sessions no chunk has touched since `cutoff` (their entry went away without
    /// ending them); returns how many.
    pub fn end_sessions_idle_since(&self, cutoff: Instant) -> usize {
        let mut state = self.lock();
        let idle: Vec<SessionId> = state
            .sessions
            .iter()
            .filter(|(_, cache)| cache.last_used < cutoff)
            .map(|(session, _)| *session)
            .collect();
        for session in &idle {
            if let Some(cache) = state.sessions.remove(session) {
                state.used_bytes = state.used_bytes.saturating_sub(cache.bytes);
            }
        }
        idle.len()
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

    /// Starts `child` as a copy of the first `len` positions of `parent`'s cache, so that
    /// several continuations of one prompt share its prefill. Refused when `parent` holds fewer
    /// than `len` positions (or is unknown or computing), when `child` already exists, and
    /// when the copy does not fit the budget.
    pub fn fork(&self, parent: SessionId, child: SessionId, len: usize) -> Result<()> {
        let mut state = self.lock();
        if state.sessions.contains_key(&child) || state.computing.contains(&child) {
            return Err(ModelError::Fork(format!("session {child} already exists")));
        }
        let source = state.sessions.get(&parent).ok_or_else(|| {
            ModelError::Fork(format!(
                "session {parent} is not cached here (or is computing)"
            ))
        })?;
        if source.len < len {
            return Err(ModelError::Fork(format!(
                "session {parent} holds {} positions, not the {len} to copy",
                source.len
            )));
        }
        let copy = source.prefix(len);
        if state.used_bytes + copy.bytes > self.budget_bytes {
            return Err(ModelError::CacheBudget {
                needed: copy.bytes,
                used: state.used_bytes,
                budget: self.budget_bytes,
            });
        }
        state.used_bytes += copy.bytes;
        state.sessions.insert(child, copy);
        Ok(())
    }

    /// Cuts a session's cache back to its first `len` positions, freeing the rest (drafted
    /// tokens that were rejected). A session holding `len` positions or fewer, or none, is
    /// left as it is; a session computing a chunk right now is refused.
    pub fn rewind(&self, session: SessionId, len: usize) -> Result<()> {
        let mut state = self.lock();
        if state.computing.contains(&session) {
            return Err(ModelError::PositionMismatch {
                session: session.to_string(),
                position: len,
                cached: len,
                kind: "another chunk of the session is still computing",
            });
        }
        let Some(cache) = state.sessions.get_mut(&session) else {
            return Ok(());
        };
        if cache.len <= len {
            return Ok(());
        }
        let before = cache.bytes;
        *cache = cache.prefix(len);
        let after = cache.bytes;
        state.used_bytes = state.used_bytes - before + after;
        Ok(())
    }

    /// Drops a session's cache, freeing its bytes; a session computing a chunk right now is
    /// dropped when the chunk finishes. Unknown sessions are ignored.
    pub fn end_session(&self, session: SessionId) {
        let mut state = self.lock();
        if let Some(cache) = state.sessions.remove(&session) {
            state.used_bytes = state.used_bytes.saturating_sub(cache.bytes);
        }
        if state.computing.contains(&session) {
            state.ended_while_computing.insert(session);
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
        let mut lease = self.check_out(session, position, tokens)?;
        let outcome = compute(lease.cache());
        lease.finish(outcome.is_ok());
        outcome
    }

    /// Takes the session's cache out of the store for a chunk of `tokens` positions starting at
    /// `position` (which must be exactly where the cache ends), reserving the chunk's bytes.
    /// Several sessions can be checked out at once, so one pass can compute them together;
    /// [`SessionLease::finish`] puts each back. A lease dropped unfinished (a panic) drops the
    /// session's cache and frees its bytes.
    pub(crate) fn check_out(
        &self,
        session: SessionId,
        position: usize,
        tokens: usize,
    ) -> Result<SessionLease<'_>> {
        let needed = tokens * self.bytes_per_position;
        let cache = {
            let mut state = self.lock();
            let cached = state.sessions.get(&session).map_or(0, SessionCache::len);
            if state.computing.contains(&session) {
                return Err(ModelError::PositionMismatch {
                    session: session.to_string(),
                    position,
                    cached,
                    kind: "another chunk of the session is still computing",
                });
            }
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
            state.computing.insert(session);
            state
                .sessions
                .remove(&session)
                .unwrap_or_else(|| SessionCache::new(self.layer_count))
        };
        Ok(SessionLease {
            checked_out: CheckedOut {
                store: self,
                session,
                released: needed + cache.bytes,
            },
            lengths: cache.layers.iter().map(|layer| layer.keys.len()).collect(),
            before_bytes: cache.bytes,
            cache,
            end: position + tokens,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StoreState> {
        // A panic inside `compute` never holds the lock, so a poisoned mutex still has
        // consistent contents.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A session taken out of the store while a chunk computes on it.
struct CheckedOut<'a> {
    store: &'a KvStore,
    session: SessionId,
    /// The chunk's reservation plus the bytes the session held when it was taken out (still
    /// counted in `used_bytes` while it computes).
    released: usize,
}

impl<'a> CheckedOut<'a> {
    /// Returns the reservation and the session's old bytes to the budget and marks the session
    /// no longer computing; the caller puts the cache back (counting its bytes) if it keeps it.
    fn finish(self) -> std::sync::MutexGuard<'a, StoreState> {
        let store = self.store;
        let session = self.session;
        let released = self.released;
        std::mem::forget(self);
        release(store, session, released)
    }
}

impl Drop for CheckedOut<'_> {
    fn drop(&mut self) {
        let mut state = release(self.store, self.session, self.released);
        state.ended_while_computing.remove(&self.session);
    }
}

/// A session's cache checked out of its [`KvStore`] for one chunk.
pub(crate) struct SessionLease<'a> {
    checked_out: CheckedOut<'a>,
    cache: SessionCache,
    /// Each layer's key count before the chunk, to undo a failed chunk.
    lengths: Vec<usize>,
    before_bytes: usize,
    /// The session's length once the chunk is in.
    end: usize,
}

impl SessionLease<'_> {
    /// The cache the chunk appends to.
    pub(crate) fn cache(&mut self) -> &mut SessionCache {
        &mut self.cache
    }

    /// Puts the cache back: with the chunk when it `succeeded`, else as it was before (a
    /// session with nothing cached is dropped). A session ended meanwhile is dropped.
    pub(crate) fn finish(self, succeeded: bool) {
        let SessionLease {
            checked_out,
            mut cache,
            lengths,
            before_bytes,
            end,
        } = self;
        let session = checked_out.session;
        let mut state = checked_out.finish();
        let ended = state.ended_while_computing.remove(&session);
        if succeeded {
            cache.len = end;
            cache.last_used = Instant::now();
        } else {
            cache.truncate(&lengths);
            cache.bytes = before_bytes;
        }
        if !ended && (succeeded || cache.len > 0) {
            state.used_bytes += cache.bytes;
            state.sessions.insert(session, cache);
        }
    }
}

fn release(
    store: &KvStore,
    session: SessionId,
    released: usize,
) -> std::sync::MutexGuard<'_, StoreState> {
    let mut state = store.lock();
    state.used_bytes = state.used_bytes.saturating_sub(released);
    state.computing.remove(&session);
    state
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes of one position of [`chunk`]'s rows: keys and values of 2 heads of 4.
    const CHUNK_POSITION_BYTES: usize = 2 * 2 * 4 * CACHED_VALUE_BYTES;

    /// Bytes of one position of [`append_numbered`]'s rows: 2 layers, keys and values of 2.
    const NUMBERED_POSITION_BYTES: usize = 2 * 2 * 2 * CACHED_VALUE_BYTES;

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
        let store = KvStore::new(1, CHUNK_POSITION_BYTES, 1 << 20);
        let session = SessionId::new_v4();
        append(&store, session, 0, 3).unwrap();
        append(&store, session, 3, 1).unwrap();
        assert_eq!(store.session_len(session), 4);
        assert_eq!(store.used_bytes(), 4 * CHUNK_POSITION_BYTES);
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

    /// Rows whose values name their position, `[tokens, 2]` for keys and negated for values.
    fn numbered_rows(first: usize, tokens: usize) -> (Vec<f32>, Vec<f32>) {
        let keys: Vec<f32> = (first..first + tokens)
            .flat_map(|at| [at as f32, at as f32 + 0.5])
            .collect();
        let values = keys.iter().map(|k| -k).collect();
        (keys, values)
    }

    fn append_numbered(store: &KvStore, session: SessionId, position: usize, tokens: usize) {
        store
            .with_session(session, position, tokens, |cache| {
                let (keys, values) = numbered_rows(position, tokens);
                cache.append_rows(0, &keys, &values)?;
                cache.append_rows(1, &keys, &values)?;
                Ok(())
            })
            .unwrap();
    }

    fn layer_rows(store: &KvStore, session: SessionId, layer: usize) -> (Vec<f32>, Vec<f32>) {
        let mut state = store.lock();
        let cache = state.sessions.get_mut(&session).unwrap();
        let layer = cache.layer(layer).unwrap();
        (layer.keys().to_f32_vec(), layer.values().to_f32_vec())
    }

    #[test]
    fn a_fork_copies_the_parents_first_positions_and_then_lives_on_its_own() {
        let store = KvStore::new(2, NUMBERED_POSITION_BYTES, 1 << 20);
        let parent = SessionId::new_v4();
        let child = SessionId::new_v4();
        append_numbered(&store, parent, 0, 5);
        store.fork(parent, child, 3).unwrap();
        assert_eq!(store.session_len(child), 3);
        assert_eq!(store.used_bytes(), 8 * NUMBERED_POSITION_BYTES);
        for layer in 0..2 {
            assert_eq!(layer_rows(&store, child, layer), numbered_rows(0, 3));
        }
        // The child continues at its own position 3; the parent is untouched.
        append_numbered(&store, child, 3, 1);
        assert_eq!(layer_rows(&store, child, 1), numbered_rows(0, 4));
        assert_eq!(layer_rows(&store, parent, 1), numbered_rows(0, 5));
        store.end_session(parent);
        assert_eq!(layer_rows(&store, child, 0), numbered_rows(0, 4));
        store.end_session(child);
        assert_eq!(store.used_bytes(), 0);
    }

    #[test]
    fn a_fork_is_refused_without_enough_parent_an_existing_child_or_room() {
        let store = KvStore::new(2, NUMBERED_POSITION_BYTES, 9 * NUMBERED_POSITION_BYTES);
        let parent = SessionId::new_v4();
        let child = SessionId::new_v4();
        append_numbered(&store, parent, 0, 5);
        let short = store.fork(parent, child, 6).unwrap_err().to_string();
        assert!(short.contains("holds 5 positions, not the 6"), "{short}");
        let unknown = store
            .fork(child, SessionId::new_v4(), 1)
            .unwrap_err()
            .to_string();
        assert!(unknown.contains("is not cached here"), "{unknown}");
        let exists = store.fork(parent, parent, 1).unwrap_err().to_string();
        assert!(exists.contains("already exists"), "{exists}");
        let full = store.fork(parent, child, 5).unwrap_err();
        assert!(
            matches!(
                full,
                ModelError::CacheBudget {
                    needed: 80,
                    used: 80,
                    ..
                }
            ),
            "{full}"
        );
        assert!(!store.has_session(child));
        store.fork(parent, child, 4).unwrap();
        assert_eq!(store.used_bytes(), 9 * NUMBERED_POSITION_BYTES);
    }

    #[test]
    fn tensor_chunks_come_back_joined_in_position_order() {
        let store = KvStore::new(1, 2 * 2 * 3 * CACHED_VALUE_BYTES, 1 << 20);
        let session = SessionId::new_v4();
        // `[1, heads = 2, tokens, head_dim = 3]`, each value naming its head, position, index.
        let chunk = |first: usize, tokens: usize| {
            let values: Vec<f32> = (0..2)
                .flat_map(|head| {
                    (first..first + tokens)
                        .flat_map(move |at| (0..3).map(move |i| (head * 100 + at * 10 + i) as f32))
                })
                .collect();
            Tensor::from_vec(values, (1, 2, tokens, 3), &Device::Cpu).unwrap()
        };
        let mut joined = None;
        for (first, tokens) in [(0, 2), (2, 1), (3, 2)] {
            joined = Some(
                store
                    .with_session(session, first, tokens, |cache| {
                        cache.append(0, chunk(first, tokens), chunk(first, tokens))
                    })
                    .unwrap(),
            );
        }
        let (keys, values) = joined.unwrap();
        let expected = chunk(0, 5).flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(
            keys.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            expected
        );
        assert_eq!(
            values.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            expected
        );
    }

    #[test]
    fn appended_rows_are_kept_as_their_nearest_half_floats() {
        let store = KvStore::new(1, 2 * 2 * CACHED_VALUE_BYTES, 1 << 20);
        let session = SessionId::new_v4();
        // Just above halfway between 1 and the next half float (1 + 2^-10); exactly halfway
        // (ties go to the even 1); values past the largest half float (65504) either side.
        let keys = [1.0 + 2f32.powi(-11) + 2f32.powi(-20), 1.0 + 2f32.powi(-11)];
        let values = [70_000.0, -1e30];
        store
            .with_session(session, 0, 1, |cache| {
                let layer = cache.append_rows(0, &keys, &values)?;
                assert_eq!(layer.keys().to_f32_vec(), [1.0 + 2f32.powi(-10), 1.0]);
                assert_eq!(layer.values().to_f32_vec(), [65504.0, -65504.0]);
                Ok(())
            })
            .unwrap();
        assert_eq!(store.used_bytes(), 2 * 2 * CACHED_VALUE_BYTES);
    }

    #[test]
    fn a_failed_chunk_leaves_the_cached_rows_as_they_were() {
        let store = KvStore::new(2, NUMBERED_POSITION_BYTES, 1 << 20);
        let session = SessionId::new_v4();
        let rows = |value: f32, tokens: usize| vec![value; tokens * 2];
        store
            .with_session(session, 0, 2, |cache| {
                cache.append_rows(0, &rows(1.0, 2), &rows(2.0, 2))?;
                cache.append_rows(1, &rows(3.0, 2), &rows(4.0, 2))?;
                Ok(())
            })
            .unwrap();
        let failed: Result<()> = store.with_session(session, 2, 1, |cache| {
            cache.append_rows(0, &rows(9.0, 1), &rows(9.0, 1))?;
            Err(ModelError::InvalidSpan("boom".into()))
        });
        assert!(failed.is_err());
        store
            .with_session(session, 2, 1, |cache| {
                let layer = cache.append_rows(0, &rows(5.0, 1), &rows(6.0, 1))?;
                assert_eq!(layer.keys().to_f32_vec(), [1.0, 1.0, 1.0, 1.0, 5.0, 5.0]);
                assert_eq!(layer.values().to_f32_vec(), [2.0, 2.0, 2.0, 2.0, 6.0, 6.0]);
                assert_eq!(cache.layer(1).unwrap().keys().to_f32_vec(), [3.0; 4]);
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn a_rewind_drops_the_last_positions_frees_their_bytes_and_appending_goes_on_from_there() {
        let store = KvStore::new(2, NUMBERED_POSITION_BYTES, 1 << 20);
        let session = SessionId::new_v4();
        append_numbered(&store, session, 0, 3);
        append_numbered(&store, session, 3, 4);
        let full_bytes = store.used_bytes();
        store.rewind(session, 9).unwrap();
        assert_eq!(store.session_len(session), 7, "a longer length keeps all");
        store.rewind(session, 4).unwrap();
        assert_eq!(store.session_len(session), 4);
        assert_eq!(store.used_bytes(), full_bytes * 4 / 7);
        let (keys, values) = layer_rows(&store, session, 1);
        let (expected_keys, expected_values) = numbered_rows(0, 4);
        assert_eq!((keys, values), (expected_keys, expected_values));
        assert!(
            append(&store, session, 7, 1).is_err(),
            "the old end is a gap now"
        );
        append_numbered(&store, session, 4, 2);
        assert_eq!(store.session_len(session), 6);
        let (keys, _) = layer_rows(&store, session, 0);
        assert_eq!(keys, numbered_rows(0, 6).0);
        store.rewind(SessionId::new_v4(), 0).unwrap();
        store.end_session(session);
        assert_eq!(store.used_bytes(), 0);
    }

    #[test]
    fn budget_is_enforced_across_sessions() {
        let store = KvStore::new(1, CHUNK_POSITION_BYTES, CHUNK_POSITION_BYTES * 5);
        let first = SessionId::new_v4();
        let second = SessionId::new_v4();
        append(&store, first, 0, 4).unwrap();
        let error = append(&store, second, 0, 2).unwrap_err();
        assert!(matches!(error, ModelError::CacheBudget { .. }), "{error}");
        append(&store, second, 0, 1).unwrap();
        store.end_session(first);
        append(&store, second, 1, 2).unwrap();
        assert_eq!(store.used_bytes(), 3 * CHUNK_POSITION_BYTES);
    }

    #[test]
    fn failed_compute_leaves_the_session_unchanged() {
        let store = KvStore::new(1, CHUNK_POSITION_BYTES, 1 << 20);
        let session = SessionId::new_v4();
        append(&store, session, 0, 2).unwrap();
        let result: Result<()> = store.with_session(session, 2, 1, |cache| {
            let (keys, values) = chunk(1);
            cache.append(0, keys, values)?;
            Err(ModelError::InvalidSpan("boom".into()))
        });
        assert!(result.is_err());
        assert_eq!(store.session_len(session), 2);
        assert_eq!(store.used_bytes(), 2 * CHUNK_POSITION_BYTES);
        append(&store, session, 2, 1).unwrap();
    }

    #[test]
    fn a_session_ended_while_computing_is_dropped_when_the_chunk_finishes() {
        let store = KvStore::new(1, CHUNK_POSITION_BYTES, 1 << 20);
        let session = SessionId::new_v4();
        append(&store, session, 0, 2).unwrap();
        store
            .with_session(session, 2, 1, |cache| {
                assert!(store.has_session(session));
                assert_eq!(store.session_count(), 1, "a computing session counts");
                // A second chunk of the same session is refused while this one runs.
                assert!(append(&store, session, 2, 1).is_err());
                store.end_session(session);
                let (keys, values) = chunk(1);
                cache.append(0, keys, values)?;
                Ok(())
            })
            .unwrap();
        assert!(!store.has_session(session));
        assert_eq!(store.session_count(), 0);
        assert_eq!(store.used_bytes(), 0);
    }

    #[test]
    fn idle_sessions_are_reaped_and_busy_ones_kept() {
        let store = KvStore::new(1, CHUNK_POSITION_BYTES, 1 << 20);
        let before = Instant::now();
        let idle = SessionId::new_v4();
        append(&store, idle, 0, 2).unwrap();
        assert_eq!(store.end_sessions_idle_since(before), 0);
        // Both sessions were last touched before the cutoff; `busy` is then checked out for a
        // chunk, and the reaper runs while that chunk computes.
        let busy = SessionId::new_v4();
        append(&store, busy, 0, 1).unwrap();
        let cutoff = Instant::now();
        store
            .with_session(busy, 1, 1, |cache| {
                assert_eq!(
                    store.end_sessions_idle_since(cutoff),
                    1,
                    "only the idle session is reaped"
                );
                assert!(!store.has_session(idle), "the idle session is reaped");
                assert!(store.has_session(busy), "the busy session is kept");
                let (keys, values) = chunk(1);
                cache.append(0, keys, values)?;
                Ok(())
            })
            .unwrap();
        assert!(!store.has_session(idle));
        assert!(
            store.has_session(busy),
            "the busy session is back after its chunk"
        );
        assert_eq!(store.session_len(busy), 2);
        assert_eq!(store.used_bytes(), 2 * CHUNK_POSITION_BYTES);
        // Its next chunk continues where the last one ended.
        append(&store, busy, 2, 1).unwrap();
        assert_eq!(store.session_len(busy), 3);
        // Once idle itself, it goes too.
        let later = Instant::now();
        assert_eq!(store.end_sessions_idle_since(later), 1);
        assert_eq!(store.session_count(), 0);
        assert_eq!(store.used_bytes(), 0);
    }
}
