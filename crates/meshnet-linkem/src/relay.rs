//! The TCP relay: every connection accepted on the listening address is joined to a new
//! connection to the target, and each direction's bytes are delayed and rate-capped by that
//! direction's [`Shaper`].
//!
//! One shaper per direction is shared by all the relay's connections: a link's bandwidth is
//! shared. Per direction and connection, a reader reads chunks ([`LinkShape::chunk_limit`]),
//! stamps each with its delivery time and queues it in a bounded channel
//! ([`LinkShape::queue_chunks`]); a writer sleeps until each chunk's delivery time and writes it.
//! End of stream on one side half-closes the other once the queued chunks are written; an error
//! on either side ends that direction the same way, and a writer that fails stops its reader.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::error::LinkemError;
use crate::shape::{LinkShape, Shaper};

/// The jitter seed of the listen → target direction.
const FORWARD_SEED: u64 = 0x6c69_6e6b_0001;
/// The jitter seed of the target → listen direction.
const BACKWARD_SEED: u64 = 0x6c69_6e6b_0002;
/// How long the accept loop pauses after a failed accept (e.g. out of file descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// How much earlier than a delivery time the writer sets its timer. Tokio's timer counts whole
/// milliseconds and wakes a little over a millisecond late on average; setting it early and
/// yielding away what is left brings the mean lateness well under a millisecond.
const TIMER_SLACK: Duration = Duration::from_millis(1);

/// One emulated link, listening and ready to relay to its target.
#[derive(Debug)]
pub struct Relay {
    listener: TcpListener,
    link: Arc<LinkState>,
}

/// What every connection of a relay shares.
#[derive(Debug)]
struct LinkState {
    target: SocketAddr,
    /// Delivery times are measured from here.
    origin: Instant,
    chunk_limit: usize,
    queue_chunks: usize,
    forward: Mutex<Shaper>,
    backward: Mutex<Shaper>,
}

/// A chunk of the stream with the time it may be delivered.
struct Stamped {
    bytes: Vec<u8>,
    delivery: Duration,
}

impl Relay {
    /// Listens on `listen` for a link to `target` shaped by `shape` in both directions.
    pub async fn bind(
        listen: SocketAddr,
        target: SocketAddr,
        shape: LinkShape,
    ) -> Result<Self, LinkemError> {
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|source| LinkemError::Listen {
                addr: listen,
                source,
            })?;
        let link = LinkState {
            target,
            origin: Instant::now(),
            chunk_limit: shape.chunk_limit(),
            queue_chunks: shape.queue_chunks(),
            forward: Mutex::new(Shaper::new(shape, FORWARD_SEED)),
            backward: Mutex::new(Shaper::new(shape, BACKWARD_SEED)),
        };
        Ok(Self {
            listener,
            link: Arc::new(link),
        })
    }

    /// The address the relay listens on (the port the OS chose when bound to port 0).
    pub fn local_addr(&self) -> Result<SocketAddr, LinkemError> {
        let target = self.link.target;
        self.listener
            .local_addr()
            .map_err(|source| LinkemError::Relay { target, source })
    }

    /// The address the relay forwards to.
    pub fn target(&self) -> SocketAddr {
        self.link.target
    }

    /// Accepts and relays connections until the future is dropped. Each connection runs in a
    /// task of its own; what goes wrong with one (or with an accept) goes to `report`, and the
    /// relay carries on.
    pub async fn serve<F>(self, report: F)
    where
        F: Fn(LinkemError) + Send + Sync + 'static,
    {
        let report = Arc::new(report);
        let addr = self.listener.local_addr().ok();
        loop {
            match self.listener.accept().await {
                Ok((inbound, _)) => {
                    let link = Arc::clone(&self.link);
                    let report = Arc::clone(&report);
                    tokio::spawn(async move {
                        if let Err(error) = link.relay(inbound).await {
                            report(error);
                        }
                    });
                }
                Err(source) => {
                    let addr = addr.unwrap_or(self.link.target);
                    report(LinkemError::Accept { addr, source });
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
    }
}

impl LinkState {
    /// Relays one accepted connection until both directions have ended.
    async fn relay(&self, inbound: TcpStream) -> Result<(), LinkemError> {
        let target = self.target;
        let outbound = TcpStream::connect(target)
            .await
            .map_err(|source| LinkemError::Dial { target, source })?;
        for stream in [&inbound, &outbound] {
            stream.set_nodelay(true).map_err(|e| self.io_error(e))?;
        }
        let (in_read, in_write) = inbound.into_split();
        let (out_read, out_write) = outbound.into_split();
        let there = self.pump(in_read, out_write, &self.forward);
        let back = self.pump(out_read, in_write, &self.backward);
        let (there, back) = tokio::join!(there, back);
        there.and(back)
    }

    /// One direction: a reader that stamps and queues, a writer that waits and writes.
    async fn pump(
        &self,
        from: OwnedReadHalf,
        to: OwnedWriteHalf,
        shaper: &Mutex<Shaper>,
    ) -> Result<(), LinkemError> {
        let (queue, queued) = mpsc::channel(self.queue_chunks);
        let reading = self.read_chunks(from, queue, shaper);
        let writing = self.write_chunks(queued, to);
        let (read, written) = tokio::join!(reading, writing);
        read.and(written)
    }

    /// Reads chunks until end of stream, an error, or the writer has gone.
    async fn read_chunks(
        &self,
        mut from: OwnedReadHalf,
        queue: mpsc::Sender<Stamped>,
        shaper: &Mutex<Shaper>,
    ) -> Result<(), LinkemError> {
        let mut buffer = vec![0; self.chunk_limit];
        loop {
            let read = tokio::select! {
                () = queue.closed() => return Ok(()),
                read = from.read(&mut buffer) => read.map_err(|e| self.io_error(e))?,
            };
            if read == 0 {
                return Ok(());
            }
            let arrival = self.origin.elapsed();
            let delivery = shaper
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .schedule(arrival, read);
            let bytes = buffer[..read].to_vec();
            if queue.send(Stamped { bytes, delivery }).await.is_err() {
                return Ok(());
            }
        }
    }

    /// Writes each queued chunk at its delivery time; half-closes once the queue has ended.
    async fn write_chunks(
        &self,
        mut queued: mpsc::Receiver<Stamped>,
        mut to: OwnedWriteHalf,
    ) -> Result<(), LinkemError> {
        while let Some(chunk) = queued.recv().await {
            wait_until(self.origin + chunk.delivery).await;
            to.write_all(&chunk.bytes)
                .await
                .map_err(|e| self.io_error(e))?;
        }
        to.shutdown().await.map_err(|e| self.io_error(e))
    }

    fn io_error(&self, source: std::io::Error) -> LinkemError {
        LinkemError::Relay {
            target: self.target,
            source,
        }
    }
}

/// Waits until `deadline`, never returning before it: a timer set [`TIMER_SLACK`] early, then
/// yields to the runtime for what is left.
async fn wait_until(deadline: Instant) {
    if let Some(early) = deadline.checked_sub(TIMER_SLACK) {
        tokio::time::sleep_until(early).await;
    }
    while Instant::now() < deadline {
        tokio::task::yield_now().await;
    }
}
