//! Continuous batching: one compute thread per loaded span runs the work of every session
//! that uses it.
//!
//! Each caller (a generation at the entry, a `/forward` request at a peer) hands its chunk to
//! the span's thread and waits for the answer. The thread takes whatever has arrived since its
//! last pass — decode steps and prefill chunks of different sessions, up to
//! `--max-batch-tokens` rows ([`DEFAULT_MAX_BATCH_TOKENS`]) — and runs them as one pass over
//! the weights, each session with its own KV cache and position
//! ([`ModelSpan::forward_batch`]); LM-head requests are batched the same way. Sessions join and leave between any two passes, and a batched session's result has
//! the bits it would have alone. All passes run on the process's one compute pool, so however
//! many sessions there are, the cores are never oversubscribed.

use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use meshnet_model::{BatchItem, ModelError, ModelSpan, SessionId};
use meshnet_types::LayerSpan;
use serde::{Deserialize, Serialize};

/// The most rows one pass takes unless told otherwise (`--max-batch-tokens`; a 128-token
/// prefill chunk fills half). The first waiting request is always taken, whatever its size, so
/// 1 turns batching off.
pub const DEFAULT_MAX_BATCH_TOKENS: usize = 256;

/// How long a pass may wait for the rest of the sessions that ran together last time.
const GATHER_WAIT: Duration = Duration::from_millis(2);

/// How long after its last pass a session still counts as running on a span.
const RECENT: Duration = Duration::from_millis(250);

/// Requests that may wait for the span's thread before a caller blocks on handing one over.
const QUEUE_DEPTH: usize = 256;

type Reply<T> = SyncSender<Result<T, ModelError>>;

/// One caller's request.
enum Job {
    /// Run `layers` over a session's chunk.
    Layers {
        layers: LayerSpan,
        item: BatchItem,
        reply: Reply<Tensor>,
    },
    /// The next-token logits from a hidden state's last position.
    Logits {
        hidden: Tensor,
        reply: Reply<Vec<f32>>,
    },
}

/// What a pass runs: a range of layers, or the LM head (`None`).
type PassKind = Option<LayerSpan>;

impl Job {
    fn kind(&self) -> PassKind {
        match self {
            Job::Layers { layers, .. } => Some(*layers),
            Job::Logits { .. } => None,
        }
    }

    fn rows(&self) -> usize {
        match self {
            Job::Layers { item, .. } => item.hidden.dims().get(1).copied().unwrap_or(1),
            Job::Logits { .. } => 1,
        }
    }
}

/// What a span's compute thread has done since the span loaded (`/status` `batching`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchingReport {
    /// Passes over the weights (layer passes and LM-head passes).
    pub passes: u64,
    /// Requests those passes answered: the sessions' chunks and logits.
    pub requests: u64,
    /// The most sessions one pass has taken.
    pub largest_pass: u64,
    /// The most rows a pass takes.
    pub max_batch_tokens: usize,
}

#[derive(Debug, Default)]
struct Counters {
    passes: AtomicU64,
    requests: AtomicU64,
    largest_pass: AtomicU64,
}

impl Counters {
    fn count(&self, requests: usize) {
        self.passes.fetch_add(1, Ordering::Relaxed);
        self.requests.fetch_add(requests as u64, Ordering::Relaxed);
        self.largest_pass
            .fetch_max(requests as u64, Ordering::Relaxed);
    }
}

/// The handle to a span's compute thread; the thread ends when the handle is dropped.
#[derive(Debug)]
pub struct SpanBatcher {
    jobs: SyncSender<Job>,
    counters: Arc<Counters>,
    ended: Arc<Mutex<Vec<SessionId>>>,
    max_batch_tokens: usize,
}

impl SpanBatcher {
    /// Starts the compute thread for `span`, whose passes take at most `max_batch_tokens`
    /// rows.
    pub fn start(span: Arc<ModelSpan>, max_batch_tokens: usize) -> std::io::Result<Self> {
        let (jobs, queue) = sync_channel(QUEUE_DEPTH);
        let counters = Arc::new(Counters::default());
        let counted = Arc::clone(&counters);
        let company = Company::default();
        let ended = Arc::clone(&company.ended);
        std::thread::Builder::new()
            .name(format!("meshnet-span-{}", span.layers()))
            .spawn(move || run(&span, &queue, &counted, company, max_batch_tokens))?;
        Ok(SpanBatcher {
            jobs,
            counters,
            ended,
            max_batch_tokens,
        })
    }

    /// Tells the compute thread that `session` has ended, so no pass waits for it.
    pub fn forget(&self, session: SessionId) {
        lock(&self.ended).push(session);
    }

    /// What the compute thread has done so far.
    pub fn report(&self) -> BatchingReport {
        BatchingReport {
            passes: self.counters.passes.load(Ordering::Relaxed),
            requests: self.counters.requests.load(Ordering::Relaxed),
            largest_pass: self.counters.largest_pass.load(Ordering::Relaxed),
            max_batch_tokens: self.max_batch_tokens,
        }
    }

    /// Hands `item` to the compute thread, behind every request handed over before it (a
    /// session's chunks run in the order they were submitted); blocks only while the queue is
    /// full. The answer comes with [`Answer::wait`].
    pub fn submit(&self, layers: LayerSpan, item: BatchItem) -> Result<Answer<Tensor>, ModelError> {
        self.hand_over(|reply| Job::Layers {
            layers,
            item,
            reply,
        })
    }

    /// The next-token logits of `hidden`'s last position, computed together with other
    /// sessions' waiting requests; blocks until done.
    pub fn logits(&self, hidden: Tensor) -> Result<Vec<f32>, ModelError> {
        self.hand_over(|reply| Job::Logits { hidden, reply })?
            .wait()
    }

    fn hand_over<T>(&self, job: impl FnOnce(Reply<T>) -> Job) -> Result<Answer<T>, ModelError> {
        let (reply, answer) = sync_channel(1);
        self.jobs
            .send(job(reply))
            .map_err(|_| ModelError::PassFailed("the span's compute thread has stopped".into()))?;
        Ok(Answer(answer))
    }
}

/// The coming answer to a request handed to a span's compute thread.
#[derive(Debug)]
pub struct Answer<T>(Receiver<Result<T, ModelError>>);

impl<T> Answer<T> {
    /// Blocks until the pass that took the request has run.
    pub fn wait(self) -> Result<T, ModelError> {
        self.0.recv().map_err(|_| {
            ModelError::PassFailed("the computation panicked; see the peer's log".into())
        })?
    }
}

/// The compute thread: waits for work, then runs everything waiting in passes until the
/// queue is empty, and again, until every handle is gone.
fn run(
    span: &ModelSpan,
    queue: &Receiver<Job>,
    counters: &Counters,
    mut company: Company,
    max_batch_tokens: usize,
) {
    let mut waiting = VecDeque::new();
    loop {
        if waiting.is_empty() {
            match queue.recv() {
                Ok(job) => waiting.push_back(job),
                Err(_) => return,
            }
        }
        waiting.extend(queue.try_iter());
        gather(queue, &mut waiting, &mut company, max_batch_tokens);
        let batch = next_batch(&mut waiting, max_batch_tokens);
        company.ran(&batch);
        counters.count(batch.len());
        // A panic in the model fails this pass's requests (their reply channels close), not
        // the thread.
        let requests = batch.len();
        if catch_unwind(AssertUnwindSafe(|| run_batch(span, batch))).is_err() {
            tracing::error!(
                layers = %span.layers(),
                requests,
                "a pass over the span panicked; its requests failed"
            );
        }
    }
}

/// Who has been running on this span lately: what a pass waits for.
#[derive(Default)]
struct Company {
    /// For each range of layers, the sessions of its passes and when they last ran.
    sessions: HashMap<LayerSpan, HashMap<SessionId, Instant>>,
    /// Sessions whose end was announced ([`SpanBatcher::forget`]), not yet struck off.
    ended: Arc<Mutex<Vec<SessionId>>>,
}

impl Company {
    fn ran(&mut self, batch: &[Job]) {
        let now = Instant::now();
        for job in batch {
            if let Job::Layers { layers, item, .. } = job {
                self.sessions
                    .entry(*layers)
                    .or_default()
                    .insert(item.session, now);
            }
        }
    }

    /// How many requests a pass of `kind` should wait for: the sessions that ran its layers
    /// within [`RECENT`] and have not ended; for the LM head, the sessions that ran any layers
    /// here (at the entry, every running generation).
    fn expected(&mut self, kind: PassKind) -> usize {
        let ended: Vec<SessionId> = std::mem::take(&mut *lock(&self.ended));
        let now = Instant::now();
        for sessions in self.sessions.values_mut() {
            sessions.retain(|session, last| {
                now.duration_since(*last) < RECENT && !ended.contains(session)
            });
        }
        let count = match kind {
            Some(layers) => self.sessions.get(&layers).map_or(0, HashMap::len),
            None => self
                .sessions
                .values()
                .flat_map(HashMap::keys)
                .collect::<HashSet<_>>()
                .len(),
        };
        count.max(1)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Waits, at most [`GATHER_WAIT`], until as many requests of the next pass's kind are waiting
/// as sessions have lately run that kind: sessions running together finish a pass together but
/// come back a little apart (sampling, their own threads waking, other hops), and a pass
/// started on the first of them would split them into groups that each read all the weights. A
/// session running alone never waits, nor does a pass while another kind of request waits
/// behind it.
fn gather(
    queue: &Receiver<Job>,
    waiting: &mut VecDeque<Job>,
    company: &mut Company,
    max_rows: usize,
) {
    let Some(kind) = next_kind(waiting) else {
        return;
    };
    let expected = company.expected(kind);
    let deadline = Instant::now() + GATHER_WAIT;
    // A request of another kind waiting means some session is held up by this pass: run it.
    // A full pass has nothing to wait for.
    while waiting.iter().all(|job| job.kind() == kind)
        && waiting.len() < expected
        && waiting.iter().map(Job::rows).sum::<usize>() < max_rows
    {
        let left = deadline.saturating_duration_since(Instant::now());
        match queue.recv_timeout(left) {
            Ok(job) => waiting.push_back(job),
            Err(_) => return,
        }
    }
}

/// The kind of the pass [`next_batch`] would take now.
fn next_kind(waiting: &VecDeque<Job>) -> Option<PassKind> {
    waiting
        .iter()
        .find(|job| matches!(job, Job::Layers { .. }))
        .or_else(|| waiting.front())
        .map(Job::kind)
}

/// Takes the next pass: the first layer request waiting (logits only when none waits) and
/// every later request of the same kind (and, for layers, the same range) that fits `max_rows`,
/// at most one per session; the rest keep their order.
///
/// Layers go first so that sessions fall into step: a session's logits wait while the others'
/// layers run, and the next LM-head pass takes them all. Taking the front request whatever its
/// kind would let two groups of sessions alternate for good, each pass reading all the weights
/// for half of them. Logits wait at most one pass per session (each session has one request in
/// flight), so they are never starved.
fn next_batch(waiting: &mut VecDeque<Job>, max_rows: usize) -> Vec<Job> {
    let first = waiting
        .iter()
        .position(|job| matches!(job, Job::Layers { .. }))
        .unwrap_or(0);
    let Some(first) = waiting.remove(first) else {
        return Vec::new();
    };
    let mut rows = first.rows();
    let mut sessions = HashSet::new();
    if let Job::Layers { item, .. } = &first {
        sessions.insert(item.session);
    }
    let mut batch = vec![first];
    let mut kept = VecDeque::with_capacity(waiting.len());
    while let Some(job) = waiting.pop_front() {
        let fits = rows + job.rows() <= max_rows;
        let joins = fits
            && match (&batch[0], &job) {
                (
                    Job::Layers { layers, .. },
                    Job::Layers {
                        layers: next, item, ..
                    },
                ) => layers == next && sessions.insert(item.session),
                (Job::Logits { .. }, Job::Logits { .. }) => true,
                _ => false,
            };
        if joins {
            rows += job.rows();
            batch.push(job);
        } else {
            kept.push_back(job);
        }
    }
    *waiting = kept;
    batch
}

/// Runs one pass and answers its callers.
fn run_batch(span: &ModelSpan, batch: Vec<Job>) {
    let Some(Job::Layers { layers, .. }) = batch.first() else {
        let (hiddens, replies): (Vec<Tensor>, Vec<Reply<Vec<f32>>>) = batch
            .into_iter()
            .filter_map(|job| match job {
                Job::Logits { hidden, reply } => Some((hidden, reply)),
                Job::Layers { .. } => None,
            })
            .unzip();
        for (reply, logits) in replies.iter().zip(span.logits_batch(&hiddens)) {
            // A caller that gave up no longer listens.
            let _ = reply.send(logits);
        }
        return;
    };
    let layers = *layers;
    let (items, replies): (Vec<BatchItem>, Vec<Reply<Tensor>>) = batch
        .into_iter()
        .filter_map(|job| match job {
            Job::Layers { item, reply, .. } => Some((item, reply)),
            Job::Logits { .. } => None,
        })
        .unzip();
    for (reply, output) in replies.iter().zip(span.forward_batch(layers, items)) {
        let _ = reply.send(output);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn layers(start: u32, end: u32) -> LayerSpan {
        LayerSpan::new(start, end)
    }

    fn layer_job(session: u128, range: LayerSpan, tokens: usize) -> Job {
        let (reply, _) = sync_channel(1);
        Job::Layers {
            layers: range,
            item: BatchItem {
                session: uuid::Uuid::from_u128(session),
                position: 0,
                hidden: Tensor::zeros((1, tokens, 4), DType::F32, &Device::Cpu).unwrap(),
            },
            reply,
        }
    }

    fn logits_job() -> Job {
        let (reply, _) = sync_channel(1);
        Job::Logits {
            hidden: Tensor::zeros((1, 1, 4), DType::F32, &Device::Cpu).unwrap(),
            reply,
        }
    }

    fn describe<'a>(batch: impl IntoIterator<Item = &'a Job>) -> Vec<String> {
        batch
            .into_iter()
            .map(|job| match job {
                Job::Layers { layers, item, .. } => {
                    format!("{}@{layers}x{}", item.session.as_u128(), job.rows())
                }
                Job::Logits { .. } => "logits".to_owned(),
            })
            .collect()
    }

    #[test]
    fn layers_go_first_and_a_pass_takes_every_waiting_request_of_its_kind_in_order() {
        let whole = layers(0, 10);
        let mut waiting = VecDeque::from([
            logits_job(),
            layer_job(1, whole, 1),
            layer_job(2, whole, 128),
            layer_job(3, layers(0, 5), 1),
            layer_job(4, whole, 1),
            logits_job(),
        ]);
        let first = next_batch(&mut waiting, 256);
        assert_eq!(describe(&first), ["1@0..10x1", "2@0..10x128", "4@0..10x1"]);
        let second = next_batch(&mut waiting, 256);
        assert_eq!(describe(&second), ["3@0..5x1"]);
        let third = next_batch(&mut waiting, 256);
        assert_eq!(describe(&third), ["logits", "logits"]);
        assert!(waiting.is_empty());
        assert!(next_batch(&mut waiting, 256).is_empty());
    }

    #[test]
    fn a_pass_keeps_to_the_row_budget_and_one_chunk_per_session() {
        let whole = layers(0, 10);
        let mut waiting = VecDeque::from([
            layer_job(1, whole, 128),
            layer_job(1, whole, 1),
            layer_job(2, whole, 128),
            layer_job(3, whole, 1),
        ]);
        let first = next_batch(&mut waiting, 256);
        assert_eq!(describe(&first), ["1@0..10x128", "2@0..10x128"]);
        // The session's second chunk waits for its first; the small one still fits behind it.
        let second = next_batch(&mut waiting, 256);
        assert_eq!(describe(&second), ["1@0..10x1", "3@0..10x1"]);
        // A request over the budget on its own still runs, alone.
        let mut waiting = VecDeque::from([layer_job(5, whole, 300), layer_job(6, whole, 1)]);
        assert_eq!(describe(&next_batch(&mut waiting, 256)), ["5@0..10x300"]);
        assert_eq!(describe(&next_batch(&mut waiting, 256)), ["6@0..10x1"]);
    }

    #[test]
    fn a_pass_gathers_the_sessions_that_ran_with_it_unless_another_kind_waits() {
        let whole = layers(0, 10);
        let mut company = Company::default();
        company.ran(&[layer_job(1, whole, 1), layer_job(2, whole, 1)]);
        let (jobs, queue) = sync_channel(8);

        // The second session's step is on its way: the pass takes it in.
        jobs.send(layer_job(2, whole, 1)).unwrap();
        let mut waiting = VecDeque::from([layer_job(1, whole, 1)]);
        gather(&queue, &mut waiting, &mut company, 256);
        assert_eq!(describe(&waiting), ["1@0..10x1", "2@0..10x1"]);

        // It does not come (it ended): the pass goes ahead after the short wait.
        let started = Instant::now();
        let mut waiting = VecDeque::from([layer_job(1, whole, 1)]);
        gather(&queue, &mut waiting, &mut company, 256);
        assert_eq!(describe(&waiting), ["1@0..10x1"]);
        let waited = started.elapsed();
        // A thread's timed wait ends at its deadline or later, by as much as the machine's
        // load delays it: a second of slack still catches a wait that is not bounded.
        assert!(
            waited >= GATHER_WAIT && waited < GATHER_WAIT + Duration::from_secs(1),
            "{waited:?}"
        );

        // A session whose end was announced is not waited for at all.
        let ended = Arc::clone(&company.ended);
        assert_eq!(company.expected(Some(whole)), 2);
        lock(&ended).push(uuid::Uuid::from_u128(2));
        assert_eq!(company.expected(Some(whole)), 1);
        assert_eq!(company.expected(None), 1);
        company.ran(&[layer_job(2, whole, 1)]);

        // A session waits for the LM head: no waiting for the others at all.
        jobs.send(layer_job(2, whole, 1)).unwrap();
        let mut waiting = VecDeque::from([layer_job(1, whole, 1), logits_job()]);
        gather(&queue, &mut waiting, &mut company, 256);
        assert_eq!(describe(&waiting), ["1@0..10x1", "logits"]);

        // Nor when the pass is already full.
        let mut waiting = VecDeque::from([layer_job(1, whole, 1)]);
        gather(&queue, &mut waiting, &mut company, 1);
        assert_eq!(describe(&waiting), ["1@0..10x1"]);
    }
}
