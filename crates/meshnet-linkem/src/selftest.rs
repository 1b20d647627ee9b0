//! The self-test: an echo server and a relay in front of it, both in-process on 127.0.0.1 with
//! ports from the OS, and the round-trip time and throughput measured through the relay.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::LinkemError;
use crate::relay::Relay;
use crate::shape::LinkShape;

/// The size of each round-trip message.
const PING_BYTES: usize = 64;
/// How much the bulk transfer writes at a time.
const WRITE_PIECE: usize = 64 * 1024;

/// What the self-test measured, beside what the shape says it should be.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelftestReport {
    /// The median round-trip time of the small messages.
    pub rtt: Duration,
    /// Twice the shape's delay.
    pub expected_rtt: Duration,
    /// The bulk transfer's throughput in bytes per second, past its first quarter.
    pub throughput: f64,
    /// The shape's rate in bytes per second.
    pub expected_throughput: f64,
}

impl SelftestReport {
    /// How far the round-trip time is from the expected one, relative to it.
    pub fn rtt_error(&self) -> f64 {
        relative_error(self.rtt.as_secs_f64(), self.expected_rtt.as_secs_f64())
    }

    /// How far the throughput is from the expected one, relative to it.
    pub fn throughput_error(&self) -> f64 {
        relative_error(self.throughput, self.expected_throughput)
    }

    /// Whether both figures are within `tolerance` (0.1 is 10%) of their settings.
    pub fn within(&self, tolerance: f64) -> bool {
        self.rtt_error() <= tolerance && self.throughput_error() <= tolerance
    }
}

fn relative_error(measured: f64, expected: f64) -> f64 {
    (measured - expected).abs() / expected
}

/// Runs the self-test for `shape` (whose rate must be set): the median round-trip time of
/// `pings` small messages, then the throughput of `bulk` worth of data at the rate, echoed back
/// and measured where it returns, from the moment its first quarter has arrived (so the
/// bucket's initial burst and the delay do not count).
pub async fn run(
    shape: LinkShape,
    pings: usize,
    bulk: Duration,
) -> Result<SelftestReport, LinkemError> {
    let rate = shape
        .rate
        .ok_or_else(|| LinkemError::Selftest("the self-test needs a rate".into()))?;
    let echo = start_echo_server().await?;
    let localhost = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let relay = Relay::bind(localhost, echo.addr, shape).await?;
    let relay_addr = relay.local_addr()?;
    let relay_task = tokio::spawn(relay.serve(|e| eprintln!("meshnet-linkem: {e}")));
    let bulk_bytes = (bulk.as_secs_f64() * rate.get() as f64) as usize;
    let patience = patience(&shape, pings, bulk);
    let measured = tokio::time::timeout(patience, measure(relay_addr, pings, bulk_bytes)).await;
    relay_task.abort();
    echo.task.abort();
    let (rtt, throughput) =
        measured.map_err(|_| LinkemError::Selftest(format!("no result within {patience:?}")))??;
    Ok(SelftestReport {
        rtt,
        expected_rtt: 2 * shape.delay,
        throughput,
        expected_throughput: rate.get() as f64,
    })
}

/// How long the measurements may take before the self-test gives up: a minute more than five
/// times what they should take.
fn patience(shape: &LinkShape, pings: usize, bulk: Duration) -> Duration {
    let pings = u32::try_from(pings).unwrap_or(u32::MAX);
    let round_trips = shape.delay.saturating_mul(2).saturating_mul(pings);
    Duration::from_secs(60).saturating_add(round_trips.saturating_add(bulk).saturating_mul(5))
}

async fn measure(
    relay: SocketAddr,
    pings: usize,
    bulk_bytes: usize,
) -> Result<(Duration, f64), LinkemError> {
    let rtt = median_rtt(relay, pings).await?;
    let throughput = echoed_throughput(relay, bulk_bytes).await?;
    Ok((rtt, throughput))
}

struct EchoServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

/// An echo server on 127.0.0.1 with a port from the OS.
async fn start_echo_server() -> Result<EchoServer, LinkemError> {
    let want = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let listen_error = |source| LinkemError::Listen { addr: want, source };
    let listener = TcpListener::bind(want).await.map_err(listen_error)?;
    let addr = listener.local_addr().map_err(listen_error)?;
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = stream.set_nodelay(true);
                let (mut read, mut write) = stream.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    Ok(EchoServer { addr, task })
}

async fn connect(addr: SocketAddr) -> Result<TcpStream, LinkemError> {
    let stream = TcpStream::connect(addr).await.map_err(failed("connect"))?;
    stream
        .set_nodelay(true)
        .map_err(failed("set TCP_NODELAY"))?;
    Ok(stream)
}

fn failed(what: &'static str) -> impl Fn(std::io::Error) -> LinkemError {
    move |e| LinkemError::Selftest(format!("{what}: {e}"))
}

/// The median round-trip time of `pings` messages of [`PING_BYTES`], one at a time.
async fn median_rtt(relay: SocketAddr, pings: usize) -> Result<Duration, LinkemError> {
    let mut stream = connect(relay).await?;
    let mut times = Vec::with_capacity(pings);
    let mut answer = [0u8; PING_BYTES];
    for ping in 0..pings {
        let message = [ping as u8; PING_BYTES];
        let sent = Instant::now();
        stream.write_all(&message).await.map_err(failed("ping"))?;
        stream
            .read_exact(&mut answer)
            .await
            .map_err(failed("pong"))?;
        times.push(sent.elapsed());
        if answer != message {
            return Err(LinkemError::Selftest(format!(
                "ping {ping} came back altered"
            )));
        }
    }
    times.sort_unstable();
    median(&times).ok_or_else(|| LinkemError::Selftest("no pings".into()))
}

fn median(sorted: &[Duration]) -> Option<Duration> {
    let middle = sorted.len() / 2;
    match sorted.len() {
        0 => None,
        n if n % 2 == 1 => Some(sorted[middle]),
        _ => Some((sorted[middle - 1] + sorted[middle]) / 2),
    }
}

/// Writes `total` bytes through the relay and the echo server and reads them back: the bytes
/// per second from the moment a quarter of them had returned to the last.
async fn echoed_throughput(relay: SocketAddr, total: usize) -> Result<f64, LinkemError> {
    let mut stream = connect(relay).await?;
    let (mut read, mut write) = stream.split();
    let sending = async {
        let piece = [0x5a_u8; WRITE_PIECE];
        let mut left = total;
        while left > 0 {
            let n = left.min(WRITE_PIECE);
            write.write_all(&piece[..n]).await?;
            left -= n;
        }
        write.shutdown().await
    };
    let sending = async { sending.await.map_err(failed("bulk write")) };
    let ((), (quarter_at, quarter_bytes, end)) =
        tokio::try_join!(sending, receive_timed(&mut read, total))?;
    let seconds = (end - quarter_at).as_secs_f64();
    Ok((total - quarter_bytes) as f64 / seconds)
}

/// Reads `total` bytes: when the read that passed a quarter of them ended, how many had come
/// by then, and when the last arrived.
async fn receive_timed(
    read: &mut (impl AsyncReadExt + Unpin),
    total: usize,
) -> Result<(Instant, usize, Instant), LinkemError> {
    let mut buffer = vec![0u8; WRITE_PIECE];
    let mut received = 0;
    let mut quarter = None;
    while received < total {
        let n = read.read(&mut buffer).await.map_err(failed("bulk read"))?;
        if n == 0 || buffer[..n].iter().any(|&b| b != 0x5a) {
            return Err(LinkemError::Selftest(format!(
                "the bulk transfer came back short or altered after {received} of {total} bytes"
            )));
        }
        received += n;
        if quarter.is_none() && received * 4 >= total {
            quarter = Some((Instant::now(), received));
        }
    }
    let (at, bytes) = quarter.ok_or_else(|| LinkemError::Selftest("nothing to send".into()))?;
    if bytes >= total {
        return Err(LinkemError::Selftest(
            "the bulk transfer came back in one piece: too small to time".into(),
        ));
    }
    Ok((at, bytes, Instant::now()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        let ms = Duration::from_millis;
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[ms(1), ms(5), ms(9)]), Some(ms(5)));
        assert_eq!(median(&[ms(1), ms(4), ms(6), ms(9)]), Some(ms(5)));
    }

    #[test]
    fn within_checks_both_figures() {
        let report = SelftestReport {
            rtt: Duration::from_millis(105),
            expected_rtt: Duration::from_millis(100),
            throughput: 880.0,
            expected_throughput: 1000.0,
        };
        assert!((report.rtt_error() - 0.05).abs() < 1e-9);
        assert!((report.throughput_error() - 0.12).abs() < 1e-9);
        assert!(!report.within(0.10));
        assert!(report.within(0.12 + 1e-9));
    }
}
